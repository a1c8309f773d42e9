"""Training one segment at a time (issue 47, src/transformers_k3/segments.py).

KDA's initial state is differentiable: a sequence run in two halves, the second from the first's final state, gives
the one-shot run's outputs and every input's gradient including the initial state's (fla's ``dh0``), on the kernel
and PyTorch paths, and float64's initial-state gradient is fla's naive recurrence's. On the tiny K3 (KDA, MLA, latent
MoE, AttnRes): exact mode's gradients over k = 1, 2, 4, 8 segments are full-context backpropagation's; truncated
mode's are those of a full-context forward (no cache) whose prefix is detached where its state is made, and of
``model(segment, past_key_values=cache, labels=...)`` from a prefix cache filled without gradients; a cache a training forward filled continues training once detached.

Tolerances: fp32, the gradient over all parameters within 1e-5 relative (norm of the difference over norm of the
reference) and each parameter's within 1e-5 of that whole gradient's norm. A per-parameter relative bound is not
used: the KDA gate parameters' gradients (A_log, dt_bias) are sums with cancellation whose fp32 full-context value
is itself ~4e-5 (relative) from the float64 model's, so no fp32 computation order meets it.
"""

import copy

import pytest
import torch

from transformers_k3 import KimiK3ForCausalLM, KimiK3HybridCache, KimiK3InputError, KimiK3TextConfig, kernelize
from transformers_k3.ops import cpu_kernel
from transformers_k3.ops.kda import chunk_kda
from transformers_k3.ops.kda.naive import naive_recurrent_kda
from transformers_k3.segments import (
    KimiK3SegmentError,
    boundary_states,
    detach_cache,
    segment_backward,
    segment_bounds,
)

from references import VOCAB, KimiLinearForCausalLM, _load_fla_naive, kimi_linear_config, make_inputs, randomize_

NAMES = "q k v g beta h0".split()


def _kernel_modes():
    return [False] + ([True] if cpu_kernel.library() is not None else [])


# --------------------------------------------------------------------------------------------------
# KDA: the initial state's gradient


def _run_kda(inputs, cotangents, pieces, kernel: bool, **kwargs):
    """``chunk_kda`` over ``pieces`` (consecutive token ranges), each from the state the previous left: the
    outputs, the final state and the gradients of ``<o, o_bar> + <S_T, s_bar>`` for q, k, v, g, beta, h0."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    state, outs = leaves[5], []
    for start, end in pieces:
        o, state = chunk_kda(*(x[:, start:end] for x in leaves[:5]), initial_state=state,
                             output_final_state=True, kernel=kernel, **kwargs)  # fmt: skip
        outs.append(o)
    o = torch.cat(outs, dim=1)
    ((o * cotangents[0]).sum() + (state * cotangents[1]).sum()).backward()
    return o.detach(), state.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("kernel", _kernel_modes(), ids=lambda k: "kernel" if k else "pytorch")
@pytest.mark.parametrize("split", [1, 17, 40, 64])
def test_kda_split_in_two_equals_one_run(kernel, split):
    """Two halves chained through the final state = one run: outputs, final state and all six gradients (fp32)."""
    inputs = make_inputs(2, 90, 2, 16, 16, "k3", seed=4, normalise=False)
    gen = torch.Generator().manual_seed(5)
    cotangents = torch.randn(2, 90, 2, 16, generator=gen), torch.randn(2, 2, 16, 16, generator=gen)
    kwargs = dict(use_qk_l2norm_in_kernel=True)
    o, s, want = _run_kda(inputs, cotangents, [(0, 90)], kernel, **kwargs)
    o2, s2, got = _run_kda(inputs, cotangents, [(0, split), (split, 90)], kernel, **kwargs)
    torch.testing.assert_close(o2, o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2, s, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(NAMES, got, want):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, scale), f"grad {name}"


def test_kda_split_in_two_float64_is_exact():
    """In float64 (the PyTorch path) the chained halves agree with the one run to float64 rounding."""
    inputs = [x.double() for x in make_inputs(1, 70, 2, 8, 8, "k3", seed=6)]
    gen = torch.Generator().manual_seed(7)
    cotangents = (torch.randn(1, 70, 2, 8, generator=gen, dtype=torch.float64),
                  torch.randn(1, 2, 8, 8, generator=gen, dtype=torch.float64))  # fmt: skip
    _, _, want = _run_kda(inputs, cotangents, [(0, 70)], kernel=False)
    _, _, got = _run_kda(inputs, cotangents, [(0, 23), (23, 50), (50, 70)], kernel=False)
    for name, a, b in zip(NAMES, got, want):
        assert (a - b).abs().max().item() <= 1e-10 * max(1.0, b.abs().max().item()), f"grad {name}"


def _naive_grads(naive, inputs, cotangents):
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, s = naive(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    ((o * cotangents[0]).sum() + (s * cotangents[1]).sum()).backward()
    return [x.grad for x in leaves]


def _cotangents(shape_o, shape_s, dtype):
    gen = torch.Generator().manual_seed(9)
    return torch.randn(shape_o, generator=gen, dtype=dtype), torch.randn(shape_s, generator=gen, dtype=dtype)


@pytest.mark.parametrize("kernel", _kernel_modes(), ids=lambda k: "kernel" if k else "pytorch")
def test_kda_initial_state_gradient_is_fla_naive(kernel):
    """The initial state's gradient (and the others) against fla's naive recurrence under autograd, which computes
    in fp32 whatever its inputs: fp32 tolerance."""
    fla, reason = _load_fla_naive()
    if fla is None:
        pytest.skip(reason)
    inputs = make_inputs(2, 50, 2, 8, 8, "k3", seed=8)
    cotangents = _cotangents((2, 50, 2, 8), (2, 2, 8, 8), torch.float32)
    _, _, got = _run_kda(inputs, cotangents, [(0, 20), (20, 50)], kernel=kernel)
    for name, a, b in zip(NAMES, got, _naive_grads(fla.naive_recurrent_kda, inputs, cotangents)):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item()), f"grad {name}"


def test_kda_initial_state_gradient_is_the_float64_recurrence():
    """Float64: the chained halves' gradients against the token-by-token recurrence (ops/kda/naive.py, float64)
    under autograd, to float64 rounding."""
    inputs = [x.double() for x in make_inputs(2, 50, 2, 8, 8, "k3", seed=8)]
    cotangents = _cotangents((2, 50, 2, 8), (2, 2, 8, 8), torch.float64)
    _, _, got = _run_kda(inputs, cotangents, [(0, 20), (20, 50)], kernel=False)
    for name, a, b in zip(NAMES, got, _naive_grads(naive_recurrent_kda, inputs, cotangents)):
        assert (a - b).abs().max().item() <= 1e-10 * max(1.0, b.abs().max().item()), f"grad {name}"


def test_kda_gradcheck_initial_state_only():
    """torch.autograd.gradcheck of the chained halves with respect to the initial state alone (float64)."""
    q, k, v, g, beta, h0 = (x.double() for x in make_inputs(1, 12, 1, 4, 3, "k3", seed=10))
    h0 = h0.clone().requires_grad_()

    def run(h):
        o1, s1 = chunk_kda(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5], initial_state=h,
                           output_final_state=True)  # fmt: skip
        o2, s2 = chunk_kda(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:], initial_state=s1,
                           output_final_state=True)  # fmt: skip
        return torch.cat([o1, o2], 1), s2

    assert torch.autograd.gradcheck(run, (h0,))


# --------------------------------------------------------------------------------------------------
# The model, segment by segment


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return kernelize(randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny())).train())  # (the fused CPU kernels)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 512, (2, 64), generator=torch.Generator().manual_seed(1))


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _relative_difference(got: dict, want: dict) -> float:
    """``|got - want| / |want|`` over every gradient together (float64 arithmetic)."""
    return float(torch.cat([(got[n].double() - want[n].double()).flatten() for n in want]).norm()
                 / torch.cat([g.double().flatten() for g in want.values()]).norm())


def _assert_same_gradients(got: dict, want: dict, tol: float = 1e-5):
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    total = torch.cat([g.flatten() for g in want.values()]).norm()
    difference = _relative_difference(got, want)
    assert difference <= tol, f"relative gradient difference {difference:.2e}"
    for name in want:
        worst = (got[name] - want[name]).norm()
        assert worst <= tol * total, f"{name}: {worst / total:.2e} of the gradient's norm"


@pytest.fixture(scope="module")
def full_context(model, ids):
    """Full-context backpropagation: the reference."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), _grads(model)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_exact_mode_is_full_context_backprop(model, ids, full_context, k):
    """k segments (64, 32, 16 or 8 tokens: the chunked and the short-step paths of KDA and MLA), recomputed in
    reverse from the saved boundary states: the loss and every parameter's gradient of full-context backprop."""
    loss, want = full_context
    result = segment_backward(model, ids, segment_len=64 // k, mode="exact")
    assert len(result.segment_losses) == k
    torch.testing.assert_close(result.loss, loss, atol=1e-5, rtol=1e-5)
    _assert_same_gradients(_grads(model), want)


def test_exact_mode_with_ignored_labels_and_uneven_segments(model, ids):
    """Labels with ignored tokens (also at a segment boundary) and a last segment shorter than the others."""
    labels = ids.clone()
    labels[:, 20:25] = -100
    labels[0, 40] = -100
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=labels).loss
    loss.backward()
    want = _grads(model)
    result = segment_backward(model, ids, labels, segment_len=24, mode="exact")
    assert [len(range(*b)) for b in segment_bounds(64, 24)] == [24, 24, 16]
    torch.testing.assert_close(result.loss, loss.detach(), atol=1e-5, rtol=1e-5)
    _assert_same_gradients(_grads(model), want)


def _detach_rows(prefix: int):
    """A forward hook making the first ``prefix`` token rows of a module's ``[B, T, ...]`` output a constant."""
    return lambda module, args, output: torch.cat([output[:, :prefix].detach(), output[:, prefix:]], dim=1)


def _detaching_delta_rule(chunked, prefix: int):
    """The delta rule with the prefix's k, v, g and beta constants: the recurrent state the prefix leaves is one."""
    def run(q, k, v, g, beta, **kwargs):
        k, v, g, beta = (torch.cat([x[:, :prefix].detach(), x[:, prefix:]], dim=1) for x in (k, v, g, beta))
        return chunked(q, k, v, g, beta, **kwargs)
    return run


def _detached_prefix_gradients(model, ids, segment_len):
    """Truncated mode's reference, without a cache: for each segment, one full-context forward whose prefix (the
    tokens before the segment) is detached exactly where its state is made: the prefix rows of the KDA layers' raw
    q|k|v projections (the conv window), of the delta rule's k, v, g and beta (the recurrent state), and of the MLA
    latents (kv_a_proj_with_mqa's output and the normed c_kv). The loss is the segment's tokens' share of the
    trajectory's loss. Returns (summed loss, gradients)."""
    from transformers_k3.modeling_kimi_k3 import KimiK3DeltaAttention, KimiK3MLA

    shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
    tokens = int((shift != -100).sum())
    model.zero_grad(set_to_none=True)
    total = 0.0
    for start, end in segment_bounds(ids.shape[1], segment_len):
        labels = torch.full_like(shift, -100)
        labels[:, start:end] = shift[:, start:end]
        hooks, kernels = [], {}
        for module in model.modules():
            if isinstance(module, KimiK3DeltaAttention):
                hooks += [getattr(module, name).register_forward_hook(_detach_rows(start))
                          for name in ("q_proj", "k_proj", "v_proj")]  # fmt: skip
                kernels[module] = module.kernel
                # (the layer's kernel slot, `kernelize`'s socket, is the one place the delta rule's inputs exist)
                chunked, recurrent = module.kernel or (chunk_kda, None)
                module.kernel = (_detaching_delta_rule(chunked, start), recurrent)
            elif isinstance(module, KimiK3MLA):
                hooks += [module.kv_a_proj_with_mqa.register_forward_hook(_detach_rows(start)),
                          module.kv_a_layernorm.register_forward_hook(_detach_rows(start))]  # fmt: skip
        try:
            loss = model(ids, labels=ids, shift_labels=labels, num_items_in_batch=tokens).loss
            loss.backward()
        finally:
            for hook in hooks:
                hook.remove()
            for module, kernel in kernels.items():
                module.kernel = kernel
        total = total + loss.detach()
    return total, _grads(model)


@pytest.mark.parametrize("segment_len", [32, 16, 24])
def test_truncated_mode_is_the_full_context_forward_with_a_detached_prefix(model, ids, segment_len):
    """Truncated mode over 2, 4 and 3 (uneven) segments: each segment's gradient is that of a full-context forward
    (no cache) whose prefix's state-making quantities are constants, and the loss is the full-context loss. The
    gradients agree within 1e-5 relative, or, where fp32 rounding alone moves this tiny model's gradients further,
    within the fp32 reference's own distance from float64's (the same reference on a float64 copy, PyTorch path)."""
    loss, want = _detached_prefix_gradients(model, ids, segment_len)
    result = segment_backward(model, ids, segment_len=segment_len, mode="truncated")
    got = _grads(model)
    torch.testing.assert_close(result.loss, loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.loss, model(ids, labels=ids).loss.detach(), atol=1e-5, rtol=1e-5)
    model.zero_grad(set_to_none=True)
    float64 = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).train().double()
    float64.set_experts_implementation("eager")  # (grouped_mm takes no float64)
    float64.load_state_dict({name: value.double() for name, value in model.state_dict().items()})
    _, want64 = _detached_prefix_gradients(float64, ids, segment_len)
    assert _relative_difference(got, want64) < 1e-4  # (a sanity bound: the segments compute the reference's function)
    _assert_same_gradients(got, want, tol=max(1e-5, _relative_difference(want, want64)))


def test_truncated_mode_is_the_forward_from_a_detached_prefix(model, ids):
    """Truncated mode over two segments: the first segment's full-context gradient plus the second's from a cache
    filled by a no-grad forward of the first (the prefix a constant), with the trajectory's shifted labels."""
    shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
    tokens = int((shift != -100).sum())
    model.zero_grad(set_to_none=True)
    first = model(ids[:, :32], labels=ids[:, :32], shift_labels=shift[:, :32].contiguous(),
                  num_items_in_batch=tokens).loss  # fmt: skip
    first.backward()
    cache = KimiK3HybridCache(model.config)
    with torch.no_grad():
        model(ids[:, :32], past_key_values=cache, use_cache=True)
    second = model(ids[:, 32:], past_key_values=cache, labels=ids[:, 32:],
                   shift_labels=shift[:, 32:].contiguous(), num_items_in_batch=tokens).loss  # fmt: skip
    second.backward()
    want = _grads(model)

    result = segment_backward(model, ids, segment_len=32, mode="truncated")
    got = _grads(model)
    torch.testing.assert_close(result.loss, (first + second).detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.loss, model(ids, labels=ids).loss.detach(), atol=1e-5, rtol=1e-5)
    model.zero_grad(set_to_none=True)
    _assert_same_gradients(got, want)


def test_truncated_and_exact_differ_by_the_state_gradient(model, ids, full_context):
    """The modes are not the same computation: truncated drops the gradient through the boundary state."""
    segment_backward(model, ids, segment_len=16, mode="truncated")
    truncated = _grads(model)
    diff = torch.cat([(truncated[n] - full_context[1][n]).flatten() for n in truncated]).norm()
    assert diff > 1e-3 * torch.cat([g.flatten() for g in full_context[1].values()]).norm()


def test_a_trained_cache_continues_once_detached(model, ids):
    """A cache a training forward filled holds that forward's graph: the next segment's backward fails through it
    (freed). detach_cache makes the state a constant, and the continuation's gradient is then truncated mode's."""
    cache = KimiK3HybridCache(model.config)
    model.zero_grad(set_to_none=True)
    model(ids[:, :40], past_key_values=cache, labels=ids[:, :40]).loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        model(ids[:, 40:], past_key_values=cache, labels=ids[:, 40:]).loss.backward()
    model.zero_grad(set_to_none=True)

    cache = KimiK3HybridCache(model.config)
    model(ids[:, :40], past_key_values=cache, labels=ids[:, :40]).loss.backward()
    model.zero_grad(set_to_none=True)
    loss = model(ids[:, 40:48], past_key_values=detach_cache(cache), labels=ids[:, 40:48]).loss
    loss.backward()
    got = _grads(model)
    fresh = KimiK3HybridCache(model.config)
    with torch.no_grad():
        model(ids[:, :40], past_key_values=fresh, use_cache=True)
    model(ids[:, 40:48], past_key_values=fresh, labels=ids[:, 40:48]).loss.backward()
    _assert_same_gradients(got, _grads(model))


def test_boundary_states_are_the_full_context_caches(model, ids):
    """The no-grad pass's boundary state at token s is the state a cache holds after the first s tokens."""
    boundaries, latents = boundary_states(model, ids, 24)
    assert [b.start for b in boundaries] == [0, 24, 48] and boundaries[0].kda == {}
    cache = KimiK3HybridCache(model.config)
    with torch.no_grad():
        model(ids[:, :48], past_key_values=cache, use_cache=True)
    for i, (state, window) in boundaries[2].kda.items():
        torch.testing.assert_close(state, cache.kda_layer(i).recurrent_state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(window, cache.kda_layer(i).conv_state, atol=1e-5, rtol=1e-5)
    assert sorted(latents) == [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    for i, latent in latents.items():
        assert latent.shape[1] == 64
        torch.testing.assert_close(latent[:, :48], cache.layers[i].latent[:, :48], atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_named(model, ids):
    with pytest.raises(KimiK3SegmentError, match="mode"):
        segment_backward(model, ids, segment_len=8, mode="full")
    with pytest.raises(KimiK3SegmentError, match="segment_len"):
        segment_backward(model, ids, segment_len=0)
    with pytest.raises(KimiK3SegmentError, match="labels"):
        segment_backward(model, ids, ids[:, :10], segment_len=8)
    with pytest.raises(KimiK3SegmentError, match="no token has a label"):
        segment_backward(model, ids, torch.full_like(ids, -100), segment_len=8)
    with pytest.raises(KimiK3SegmentError, match="cu_seq_lens describe one packed row"):
        segment_backward(model, ids, segment_len=16, cu_seq_lens_q=torch.tensor([0, 40, 64], dtype=torch.int32))
    with pytest.raises(KimiK3InputError, match="position_ids of a packed row"):
        segment_backward(model, ids, segment_len=16, position_ids=torch.arange(64).expand(2, -1) % 30 + 1)


PACKED_LENGTHS = (40, 6, 8, 30, 12)  # two sequences longer than a 16-token segment, three shorter


@pytest.fixture(scope="module")
def packed_row():
    """One row packing five sequences as DataCollatorWithFlattening packs them (labels -100 at each sequence's first
    token, position_ids restarting at 0, cu_seq_lens)."""
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(5)
    sequences = [torch.randint(3, 512, (n,), generator=generator) for n in PACKED_LENGTHS]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s.tolist()} for s in sequences])
    return sequences, batch


@pytest.mark.parametrize("keys", [("position_ids",), ("cu_seq_lens_q", "cu_seq_lens_k"), ("position_ids",
                                  "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")])
def test_packed_rows_train_as_their_sequences(model, packed_row, keys):
    """A packed row (DataCollatorWithFlattening's, marked by position_ids or cu_seq_lens): exact mode has the loss and
    gradients of the model's full-context forward of the packed row (each sequence from an empty state), and truncated
    mode those of its sequences trained one by one as trajectories of their own, divided by the row's label count."""
    sequences, batch = packed_row
    ids, labels = batch["input_ids"], batch["labels"]
    packing = {key: batch[key] for key in keys}
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=labels, position_ids=batch["position_ids"]).loss
    loss.backward()
    want = _grads(model)
    result = segment_backward(model, ids, labels, segment_len=16, mode="exact", **packing)
    torch.testing.assert_close(result.loss, loss.detach(), atol=1e-5, rtol=1e-5)
    _assert_same_gradients(_grads(model), want)

    tokens = int((labels[:, 1:] != -100).sum())
    for sequence in sequences:
        segment_backward(model, sequence[None], segment_len=16, mode="truncated", num_items_in_batch=tokens)
    want = _grads(model)
    result = segment_backward(model, ids, labels, segment_len=16, mode="truncated", **packing)
    torch.testing.assert_close(result.loss, loss.detach(), atol=1e-5, rtol=1e-5)  # (the same forward, in pieces)
    _assert_same_gradients(_grads(model), want)


def test_packed_rows_of_a_batch_train_row_by_row(model, packed_row):
    """Two packed rows ([2, T] position_ids restarting in each, at other places): the gradients of each row's packed
    full-context forward, summed with the batch's label count."""
    sequences, batch = packed_row
    ids = torch.cat([batch["input_ids"], batch["input_ids"].flip(1)])
    positions = torch.cat([batch["position_ids"], torch.cat([torch.arange(n) for n in PACKED_LENGTHS[::-1]])[None]])
    tokens = 2 * (ids.shape[1] - 1)
    model.zero_grad(set_to_none=True)
    for row in range(2):
        model(ids[row : row + 1], labels=ids[row : row + 1], position_ids=positions[row : row + 1],
              num_items_in_batch=tokens).loss.backward()  # fmt: skip
    want = _grads(model)
    segment_backward(model, ids, segment_len=16, mode="exact", position_ids=positions)
    _assert_same_gradients(_grads(model), want)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_keeps_the_gradients(model, ids, full_context, reentrant):
    """With transformers' gradient checkpointing (both torch checkpoint kinds), exact mode over 4 segments is still
    full-context backprop and truncated mode over 2 and 3 segments has the gradients it has without checkpointing:
    each checkpointed layer takes its cached state as an input (`KimiK3CarriedState`) instead of losing the cache."""
    segment_backward(model, ids, segment_len=32, mode="truncated")
    truncated_32 = _grads(model)
    segment_backward(model, ids, segment_len=24, mode="truncated")
    truncated_24 = _grads(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    try:
        result = segment_backward(model, ids, segment_len=16, mode="exact")
        torch.testing.assert_close(result.loss, full_context[0], atol=1e-5, rtol=1e-5)
        _assert_same_gradients(_grads(model), full_context[1])
        segment_backward(model, ids, segment_len=32, mode="truncated")
        _assert_same_gradients(_grads(model), truncated_32)
        segment_backward(model, ids, segment_len=24, mode="truncated")
        _assert_same_gradients(_grads(model), truncated_24)
    finally:
        model.activation_checkpointing_disable()


def _saved_bytes(model, run) -> int:
    """Bytes of the tensors autograd keeps for the backward while ``run()`` builds its graph (each storage once,
    the parameters' not counted): the activation memory a training forward holds."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = run()
    for parameter in model.parameters():
        storages.pop(parameter.untyped_storage().data_ptr(), None)
    loss.backward()
    return sum(storages.values())


def test_gradient_checkpointing_holds_less_for_a_segment(ids):
    """A segment's forward from a 64-token cache, measured: with gradient checkpointing autograd keeps the layers'
    inputs (and the carried states), without it every layer's activations; the gradients agree (fp32, 1e-5)."""
    torch.manual_seed(0)
    model = kernelize(randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny())).train())
    long = torch.randint(3, 512, (2, 192), generator=torch.Generator().manual_seed(3))

    def segment():
        cache = KimiK3HybridCache(model.config)
        with torch.no_grad():
            model(long[:, :64], past_key_values=cache, use_cache=True)
        return model(long[:, 64:], past_key_values=cache, labels=long[:, 64:]).loss

    plain = _saved_bytes(model, segment)
    want = _grads(model)
    model.activation_checkpointing_enable()
    checkpointed = _saved_bytes(model, segment)
    _assert_same_gradients(_grads(model), want)
    print(f"saved for backward: {plain} bytes plain, {checkpointed} checkpointed")
    assert checkpointed < plain / 2


def _flat_grads(model, dtype, run, autocast: bool) -> torch.Tensor:
    """All parameter gradients (float64, flattened) of ``run(copy)`` on a copy of ``model`` in ``dtype``, under bf16
    autocast with ``autocast``."""
    copy_ = copy.deepcopy(model).to(dtype).train()
    copy_.set_experts_implementation("eager")  # (grouped_mm has no float64 kernel on CPU)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        run(copy_)
    return torch.cat([p.grad.double().flatten() for p in copy_.parameters() if p.grad is not None])


def test_bf16_segments_are_as_close_to_float64_as_a_full_context_bf16_step(one_thread):
    """bf16 weights, and fp32 weights under bf16 autocast: the gradients of exact mode (4 segments) and truncated mode
    (4 segments) are as close to float64's (the same mode in float64) as a full-context bf16 step's, and as in-tree
    Kimi Linear's full-context bf16 step (the peer, as test_parity_kimi_linear bounds K3's: within 1.25x). At the
    initialisation: at `randomize_`'s std 0.08 bf16 gradients are chaotic (docs/correctness.md, "bf16 gradients")."""
    torch.manual_seed(0)
    peer = KimiLinearForCausalLM(kimi_linear_config())
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny())
    ids = torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))

    def full(m):
        m(input_ids=ids, labels=ids).loss.backward()

    def exact(m):
        segment_backward(m, ids, segment_len=16, mode="exact")

    def truncated(m):
        segment_backward(m, ids, segment_len=16, mode="truncated")

    peer_want = _flat_grads(peer, torch.float64, full, False)
    want = {run: _flat_grads(model, torch.float64, run, False) for run in (full, truncated)}
    want[exact] = want[full]  # (exact mode is full-context backprop)
    for autocast in (False, True):
        dtype = torch.float32 if autocast else torch.bfloat16

        def error(m, run, reference):
            got = _flat_grads(m, dtype, run, autocast)
            return ((got - reference).norm() / reference.norm()).item()

        peer_error = error(peer, full, peer_want)
        full_error = error(model, full, want[full])
        errors = {"exact": error(model, exact, want[exact]), "truncated": error(model, truncated, want[truncated])}
        # (the peer itself: bf16's 2**-9 rounding grown through the layers, more under autocast; docs/segments.md)
        assert peer_error <= 0.15, peer_error
        assert full_error <= 1.25 * peer_error, (autocast, full_error, peer_error)
        assert all(e <= 1.25 * min(full_error, peer_error) for e in errors.values()), (autocast, errors, full_error,
                                                                                       peer_error)  # fmt: skip


def test_a_compiled_segment_forward_has_eager_gradients(one_thread):
    """torch.compile(fullgraph=True) of the model, run on a segment from a cache a no-grad prefix filled (truncated
    mode's step), with the loss: the graph holds the whole forward (a break raises) and its loss and gradients are
    eager's. The cache it leaves holds eager's latents, and an eager decode step and segment continued from it give
    eager's logits. The backend is aot_eager (dynamo capture, AOTAutograd's forward and backward graphs, no code
    generation, as in test_compile_packed)."""
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()), std=0.05).train()
    ids = torch.randint(3, 512, (2, 72), generator=torch.Generator().manual_seed(1))

    def segment(forward):
        cache = KimiK3HybridCache(model.config)
        with torch.no_grad():
            model(ids[:, :32], past_key_values=cache, use_cache=True)
        loss = forward(input_ids=ids[:, 32:48], past_key_values=cache, labels=ids[:, 32:48]).loss
        loss.backward()
        return loss.detach(), _grads(model), cache

    def latents(cache):
        held = cache.state().latents
        return [held[i] for i in sorted(held)]

    def continued(cache):
        with torch.no_grad():  # a decode step (absorbed attention), then a segment (blockwise)
            return [model(ids[:, start:end], past_key_values=cache).logits for start, end in ((48, 49), (49, 72))]

    model.zero_grad(set_to_none=True)
    want = segment(model)
    torch._dynamo.reset()
    got = segment(torch.compile(model, fullgraph=True, backend="aot_eager"))
    torch._dynamo.reset()
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    _assert_same_gradients(got[1], want[1])
    assert got[2].get_seq_length() == want[2].get_seq_length() == 48
    torch.testing.assert_close(latents(got[2]), latents(want[2]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(continued(got[2]), continued(want[2]), atol=1e-5, rtol=1e-5)
    assert got[2].get_seq_length() == 72
    torch.testing.assert_close(latents(got[2]), latents(want[2]), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_segments_under_gradient_checkpointing_have_eager_gradients(one_thread):
    """torch.compile(fullgraph=True) of a model with gradient checkpointing (non-reentrant, transformers' default),
    trained by `segment_backward` in 24-token segments (past MLA's absorbed path: its attention under autograd over a
    context) in exact and truncated mode: a graph break raises, and the loss and gradients are eager's. aot_eager
    backend, as above."""
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()), std=0.05).train()
    model.activation_checkpointing_enable()
    ids = torch.randint(3, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    try:
        for mode in ("exact", "truncated"):
            model.zero_grad(set_to_none=True)
            want = segment_backward(model, ids, segment_len=24, mode=mode).loss, _grads(model)
            got = segment_backward(compiled, ids, segment_len=24, mode=mode).loss, _grads(model)
            torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
            _assert_same_gradients(got[1], want[1])
    finally:
        torch._dynamo.reset()


def test_exact_and_truncated_on_the_pytorch_path(model, ids):
    """Without the fused CPU kernels (the PyTorch KDA and attention paths), exact mode over 4 segments is full-context
    backprop, truncated mode over 2 is the forward from a no-grad prefix cache and over 4 the full-context forward
    with a detached prefix."""
    kernelize(model, False)
    try:
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        want = _grads(model)
        result = segment_backward(model, ids, segment_len=16, mode="exact")
        torch.testing.assert_close(result.loss, loss.detach(), atol=1e-5, rtol=1e-5)
        _assert_same_gradients(_grads(model), want)

        shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
        tokens = int((shift != -100).sum())
        model(ids[:, :32], labels=ids[:, :32], shift_labels=shift[:, :32].contiguous(),
              num_items_in_batch=tokens).loss.backward()  # fmt: skip
        cache = KimiK3HybridCache(model.config)
        with torch.no_grad():
            model(ids[:, :32], past_key_values=cache, use_cache=True)
        model(ids[:, 32:], past_key_values=cache, labels=ids[:, 32:], shift_labels=shift[:, 32:].contiguous(),
              num_items_in_batch=tokens).loss.backward()  # fmt: skip
        want = _grads(model)
        segment_backward(model, ids, segment_len=32, mode="truncated")
        _assert_same_gradients(_grads(model), want)
        _, want = _detached_prefix_gradients(model, ids, 16)
        segment_backward(model, ids, segment_len=16, mode="truncated")
        _assert_same_gradients(_grads(model), want)
    finally:
        kernelize(model)


def test_exact_mode_with_peft_lora():
    """A PEFT LoRA model (adapters on the KDA projections, MLA's kv_b_proj and the output projections): exact mode over
    4 segments gives the adapters' full-context gradients."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()))
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "kv_b_proj", "o_proj"],
                             init_lora_weights=False)  # fmt: skip
    lora = peft.get_peft_model(base, config).train()
    ids = torch.randint(3, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    loss = lora(input_ids=ids, labels=ids).loss
    loss.backward()
    want = _grads(lora)
    assert want and all("lora_" in name for name in want)
    result = segment_backward(lora, ids, segment_len=16, mode="exact")
    torch.testing.assert_close(result.loss, loss.detach(), atol=1e-5, rtol=1e-5)
    _assert_same_gradients(_grads(lora), want)
