"""The gated NoPE MLA layer (`KimiK3MLA` in modeling_kimi_k3.py) by its values: against a float64 transcription of K3_SPEC.md section 5
and against transformers' in-tree Kimi Linear MLA (``KimiLinearAttention``, the same weights; K3's output gate off,
where the two layers are the same function). Each path the layer has is checked against those references, never
against another of its own paths: a prefill, decode steps on a cache (attended in latent space), a chunk of tokens on
a cache (blockwise under SDPA, merged over context blocks by log-sum-exp; expanded and masked otherwise), padded
rows, and the flash-attention family's 2-D padding mask."""

import copy
import functools

import pytest
import torch
from transformers import DynamicCache
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

import transformers_k3.modeling_kimi_k3 as mla
import transformers_k3.ops.mla_context as mla_context
from transformers_k3 import KimiK3HybridCache, KimiK3TextConfig
from transformers_k3.modeling_kimi_k3 import KimiK3MLA, checkpointed_block_attention, uses_blockwise_attention
from transformers_k3.ops.mla_context import mla_context_attention

from references import k3_config_matching, kimi_linear_config, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

IMPLEMENTATIONS = ["eager", "sdpa"]


def reference_mla(layer: KimiK3MLA, x: torch.Tensor, mask: torch.Tensor | None = None,
                  last: int | None = None, weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """K3_SPEC.md section 5 in float64 over a whole sequence ``x [B, S, H]``, causal (``mask [B, S]``: 1 = a token,
    0 = padding, which no query attends to); the outputs of the ``last`` tokens only, if given. Weights read by name
    from the checkpoint layout (``weights``: those given instead, e.g. float64 leaves for their gradients); eps as the
    config says (``mla_latent_norm_eps``, null: ``rms_norm_eps``)."""
    config = layer.config
    eps = config.mla_latent_norm_eps if config.mla_latent_norm_eps is not None else config.rms_norm_eps
    n, dn, dr, dv, r = (config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim,
                        config.v_head_dim, config.kv_lora_rank)  # fmt: skip
    w = {name: p.detach().double() for name, p in layer.named_parameters()} | (weights or {})
    x = x.double()
    batch, seq, _ = x.shape

    def rms(v, weight):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight

    rows = seq if last is None else last
    queries = x[:, seq - rows:]
    if config.q_lora_rank is None:  # (a full-rank query, as DeepSeek-V2-Lite's)
        q = (queries @ w["q_proj.weight"].T).view(batch, rows, n, dn + dr)
    else:
        c_q = rms(queries @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"])           # step 1
        q = (c_q @ w["q_b_proj.weight"].T).view(batch, rows, n, dn + dr)                  # step 2
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    kv = x @ w["kv_a_proj_with_mqa.weight"].T                                             # step 3
    c_kv, k_pe = kv[..., :r], kv[..., r:]
    c = rms(c_kv, w["kv_a_layernorm.weight"])                                             # step 4
    kvb = (c @ w["kv_b_proj.weight"].T).view(batch, seq, n, dn + dv)                      # step 5
    k_nope, v = kvb[..., :dn], kvb[..., dn:]
    scores = (torch.einsum("bthd,bshd->bhts", q_nope, k_nope)
              + torch.einsum("bthd,bsd->bhts", q_pe, k_pe)) * (dn + dr) ** -0.5           # steps 6-7: no rotation
    allowed = torch.ones(rows, seq, dtype=torch.bool).tril(seq - rows)[None, None]
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(batch, rows, n * dv)  # step 8
    if config.mla_use_output_gate:
        o = o * torch.sigmoid(queries @ w["g_proj.weight"].T)                             # step 9
    return o @ w["o_proj.weight"].T                                                       # step 10


def additive_causal(q_len: int, seq: int) -> torch.Tensor:
    """``[1, 1, q_len, seq]`` additive mask: the last ``q_len`` of ``seq`` tokens, each attending to those before it."""
    keep = torch.ones(q_len, seq, dtype=torch.bool).tril(seq - q_len)
    return torch.zeros(q_len, seq).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]


def k3_layer(implementation: str, **overrides) -> KimiK3MLA:
    config = KimiK3TextConfig.tiny(**overrides)
    config._attn_implementation = implementation
    layer_idx = config.layer_types.index("full_attention")
    return randomize_(KimiK3MLA(config, layer_idx).eval(), seed=3)


def hidden(batch: int, seq: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, seq, width, generator=torch.Generator().manual_seed(seed))


def steps_on_a_cache(layer: KimiK3MLA, x: torch.Tensor, splits, masked: bool, cache=None) -> torch.Tensor:
    """The layer run over ``x`` in pieces of ``splits`` tokens on one cache, concatenated. ``masked``: each piece
    gets its end-aligned causal mask (as the model builds for eager); otherwise none, as the model leaves it out for
    a chunk it expects to go blockwise, which a layer that decides otherwise (eager; another device; autograd) must
    still attend causally to the cache's end. (An eager prefill always gets its mask: eager attends where it says.)"""
    cache = KimiK3HybridCache(layer.config) if cache is None else cache
    outs, start = [], 0
    for size in splits:
        first = start == 0 and layer.config._attn_implementation == "eager"
        mask = additive_causal(size, start + size) if masked or first else None
        outs.append(layer(x[:, start:start + size], attention_mask=mask, past_key_values=cache)[0])
        start += size
    return torch.cat(outs, 1)


# --------------------------------------------------------------------------------------------------
# Against the float64 formula
@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("q_lora_rank", [32, None])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_prefill_matches_the_float64_formula(implementation, q_lora_rank, gate):
    layer = k3_layer(implementation, mla_use_output_gate=gate, q_lora_rank=q_lora_rank)
    x = hidden(2, 13, layer.config.hidden_size)
    want = reference_mla(layer, x)
    with torch.no_grad():
        got = layer(x, attention_mask=additive_causal(13, 13))[0]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_the_output_gate_multiplies_the_heads_before_o_proj():
    """The gate is not an identity in these weights: the layer with and without it differ as the formula says."""
    layer = k3_layer("eager")
    x = hidden(1, 6, layer.config.hidden_size, seed=1)
    with torch.no_grad():
        gated = layer(x, attention_mask=additive_causal(6, 6))[0]
        layer.config.mla_use_output_gate = False
        plain = layer(x, attention_mask=additive_causal(6, 6))[0]
        torch.testing.assert_close(plain.double(), reference_mla(layer, x), atol=1e-5, rtol=1e-5)
    assert (gated - plain).abs().max() > 1e-3


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no-mask"])
@pytest.mark.parametrize("splits", [(5, 1, 1, 1), (5, 3, 1), (7, 20), (4, 1, 17, 2)],
                         ids=["decode", "short-chunk", "long-chunk", "mixed"])
@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_steps_on_a_cache_match_the_float64_formula(implementation, masked, splits, q_lora_rank):
    """Single tokens and chunks of up to 16 attend in latent space; longer chunks expand the latent (with the mask,
    or causal to the cache's end without one) or, under SDPA without a mask, go blockwise against the cached
    context. Every one the formula over the whole sequence, at the step's positions."""
    layer = k3_layer(implementation, q_lora_rank=q_lora_rank)
    x = hidden(2, sum(splits), layer.config.hidden_size, seed=2)
    with torch.no_grad():
        got = steps_on_a_cache(layer, x, splits, masked)
    torch.testing.assert_close(got.double(), reference_mla(layer, x), atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def long_context():
    """An SDPA layer, its input, and a cache holding all but its last 24 tokens: `CONTEXT_BLOCK` + 40, so that the
    cached context is two blocks, a full and a ragged one."""
    layer = k3_layer("sdpa")
    x = hidden(1, mla.CONTEXT_BLOCK + 64, layer.config.hidden_size, seed=4)
    cache = KimiK3HybridCache(layer.config)
    with torch.no_grad():
        layer(x[:, :-24], past_key_values=cache)
    return layer, x, cache


def test_a_chunk_after_a_long_context_matches_the_formula_blockwise_and_masked(long_context):
    """A chunk on a cache under CPU SDPA without a mask attends to the cached context `CONTEXT_BLOCK` tokens at a
    time and merges the blocks by log-sum-exp; with a mask it expands everything. Both are the formula, and agree;
    decode steps after it (latent space, in blocks as well) too."""
    layer, x, prefilled = long_context
    want = reference_mla(layer, x, last=24)
    with torch.no_grad():
        assert uses_blockwise_attention(layer.config)  # the scenario: SDPA
        cache = copy.deepcopy(prefilled)
        blockwise = layer(x[:, -24:-4], past_key_values=cache)[0]
        decoded = [layer(x[:, t:t + 1], past_key_values=cache)[0] for t in range(x.shape[1] - 4, x.shape[1])]
        masked = layer(x[:, -24:-4], attention_mask=additive_causal(20, x.shape[1] - 4),
                       past_key_values=copy.deepcopy(prefilled))[0]
    torch.testing.assert_close(blockwise.double(), want[:, :20], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(masked.double(), want[:, :20], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(blockwise, masked, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(decoded, 1).double(), want[:, 20:], atol=2e-5, rtol=1e-5)


def _formula_gradients(layer, x, chunk_len, probe, context_grad=True):
    """The float64 formula's output for the last ``chunk_len`` tokens of ``x`` and, of ``(output * probe).sum()``,
    the gradients of ``x`` and of ``kv_b_proj.weight``; ``context_grad`` False: the context's inputs held constant."""
    context = x.shape[1] - chunk_len
    cached, chunk = (part.detach().double().requires_grad_() for part in x.split([context, chunk_len], 1))
    weight = layer.kv_b_proj.weight.detach().double().requires_grad_()
    want = reference_mla(layer, torch.cat([cached if context_grad else cached.detach(), chunk], 1), last=chunk_len,
                         weights={"kv_b_proj.weight": weight})
    (want * probe.double()).sum().backward()
    cached_grad = cached.grad if context_grad else torch.zeros_like(cached)
    return want.detach(), torch.cat([cached_grad, chunk.grad], 1), weight.grad


def _chunk_gradients_against_the_formula(layer, x, chunk_len, atol=2e-5, context_grad=True, forward=None):
    """A chunk of ``chunk_len`` tokens on a cache whose latents were made from ``x``'s other rows, under autograd
    (as exact mode's) or, without ``context_grad``, not (truncated mode's): its output, and the gradients (of a random
    probe) of the chunk's inputs, of the context's inputs through the cached latents (none without ``context_grad``)
    and of ``kv_b_proj.weight`` against the float64 formula under autograd. ``forward``: the layer's (compiled)."""
    x = x.detach().clone().requires_grad_()
    context = x.shape[1] - chunk_len
    cache = KimiK3HybridCache(layer.config)
    with torch.set_grad_enabled(context_grad):
        cache.update_mla(layer._latent(x[:, :context]), layer.layer_idx)
    assert uses_blockwise_attention(layer.config)  # SDPA goes blockwise, under autograd too: no [T, context] mask
    layer.kv_b_proj.weight.grad = None
    chunk = (layer if forward is None else forward)(x[:, context:], past_key_values=cache)[0]
    probe = torch.randn(chunk.shape, generator=torch.Generator().manual_seed(6))
    (chunk * probe).sum().backward()
    want, grad, weight_grad = _formula_gradients(layer, x, chunk_len, probe, context_grad)
    torch.testing.assert_close(chunk.detach().double(), want, atol=atol, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.kv_b_proj.weight.grad.double(), weight_grad, atol=1e-5, rtol=1e-5)


def test_a_chunk_with_autograd_on_a_cache_matches_the_formula():
    """Under autograd a chunk on a cache attends blockwise without a mask even when the caller gave none: its output
    and the gradients of its inputs and of the cached context's (through the latents) are the formula's."""
    layer = k3_layer("sdpa")
    _chunk_gradients_against_the_formula(layer, hidden(1, 30, layer.config.hidden_size, seed=5), 20)


def test_a_chunk_with_autograd_after_a_long_context_matches_the_formula(long_context):
    """Under autograd after two context blocks (a full and a ragged one): the merged softmax's gradient, each
    block's kernel backward taking the merged output and log-sum-exp, is the formula's."""
    layer, x, _ = long_context
    _chunk_gradients_against_the_formula(layer, x, 24)


def _operator_attention(layer, query, step, cached):
    return mla_context_attention(query, step, cached, layer.kv_b_proj.weight, layer.scaling, 8,
                                 layer.qk_nope_head_dim)[0]


def _checkpointed_attention(layer, query, step, cached):
    return checkpointed_block_attention(query, layer._expand, layer.scaling, 8, step, cached)


@pytest.mark.parametrize("attend", [_checkpointed_attention, _operator_attention], ids=["checkpointed", "operator"])
@pytest.mark.parametrize("context_grad", [True, False], ids=["context-grad", "context-detached"])
@pytest.mark.parametrize("gate", [True, False])
def test_block_attention_under_autograd_matches_the_formula(gate, context_grad, attend):
    """MLA's attention over a context under autograd outside the fused kernels, called on a layer's query and
    latents over a context of four blocks (three full, one ragged): `checkpointed_block_attention` (plain PyTorch,
    per-block checkpointed sums) and the ``transformers_k3::mla_context_attention`` operator (one opaque call, the
    expansion by ``kv_b_proj``'s weight inside). The layer's output from each, and the gradients of the chunk's
    inputs, the context's (through its latents; none when detached) and ``kv_b_proj.weight``, are the float64
    formula's."""
    layer = k3_layer("sdpa", mla_use_output_gate=gate)
    x = hidden(2, 40, layer.config.hidden_size, seed=5).requires_grad_()
    chunk_len, context = 12, 28
    latent = layer._latent(x)
    step, cached = latent[:, context:], latent[:, :context]
    out = attend(layer, layer._queries(x[:, context:]), step,
                 cached if context_grad else cached.detach())  # [B, n, T, dv]
    out = out.transpose(1, 2).reshape(2, chunk_len, -1)
    if gate:
        out = out * torch.sigmoid(layer.g_proj(x[:, context:]))
    out = layer.o_proj(out)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    (out * probe).sum().backward()
    want, grad, weight_grad = _formula_gradients(layer, x, chunk_len, probe, context_grad)
    torch.testing.assert_close(out.detach().double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.kv_b_proj.weight.grad.double(), weight_grad, atol=1e-5, rtol=1e-5)


def test_the_context_attention_operator_passes_torchs_operator_checks():
    """``transformers_k3::mla_context_attention`` by `torch.library.opcheck`: its schema, its fake implementation's
    shapes and dtypes (a graph holds it), its autograd registration against its own gradient (float64 inputs, so
    the check is not fp32 rounding) and its outputs under AOTAutograd's dispatch."""
    gen = torch.Generator().manual_seed(3)
    heads, nope, rope, value_dim, rank = 3, 6, 4, 7, 8
    query = torch.randn(2, heads, 5, nope + rope, generator=gen, dtype=torch.float64, requires_grad=True)
    step, context = (torch.randn(2, n, rank + rope, generator=gen, dtype=torch.float64, requires_grad=True)
                     for n in (5, 13))  # fmt: skip
    weight = torch.randn(heads * (nope + value_dim), rank, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.transformers_k3.mla_context_attention.default,
                          (query, step, context, weight, 0.3, 4, nope))


class _WrappedLinear(torch.nn.Module):
    """A module around ``kv_b_proj`` computing what it computes (as an adapter or a quantized layer wraps it): the
    layer can only call it, not read its weight."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped-kv_b_proj"])
@pytest.mark.parametrize("context_grad", [True, False], ids=["context-grad", "context-detached"])
def test_a_compiled_chunk_with_autograd_matches_the_formula(context_grad, wrapped):
    """torch.compile(fullgraph=True) of the layer (aot_eager: dynamo's capture and AOTAutograd's graphs) on a chunk
    after a cached context of four blocks, under autograd: the whole graph (a break raises) attends blockwise, and its
    output and gradients (chunk, context through the latents or none, ``kv_b_proj.weight``) are the formula's; also
    with ``kv_b_proj`` inside another module."""
    layer = k3_layer("sdpa")
    layer.context_block = 8
    if wrapped:
        layer.kv_b_proj = _WrappedLinear(layer.kv_b_proj)
        layer.kv_b_proj.weight = layer.kv_b_proj.linear.weight  # (the name the formula and the test read it by)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        # (a chunk of 20: more than the latent-space path takes)
        _chunk_gradients_against_the_formula(layer, hidden(2, 50, layer.config.hidden_size, seed=5), 20,
                                             context_grad=context_grad, forward=compiled)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_chunk_under_autocast_with_its_backward_outside_it(compiled):
    """bf16 autocast around the forward only (as Trainer's: its backward runs outside): the backward expands each
    context block again as the forward did, and the chunk's output and gradients (its inputs, the context's through
    the latents) are the float64 formula's within bf16's rounding; eager on CPU (the fused kernels) and compiled."""
    layer = k3_layer("sdpa")
    layer.context_block = 8
    x = hidden(2, 50, layer.config.hidden_size, seed=5).requires_grad_()
    forward = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    torch._dynamo.reset()
    try:
        cache = KimiK3HybridCache(layer.config)
        with torch.autocast("cpu", torch.bfloat16):
            cache.update_mla(layer._latent(x[:, :30]), layer.layer_idx)
            chunk = forward(x[:, 30:], past_key_values=cache)[0]  # (20 tokens: more than the latent-space path takes)
        probe = torch.randn(chunk.shape, generator=torch.Generator().manual_seed(6))
        (chunk.float() * probe).sum().backward()
    finally:
        torch._dynamo.reset()
    want, grad, _ = _formula_gradients(layer, x, 20, probe)
    for got, reference in ((chunk.detach(), want), (x.grad, grad)):
        assert (got.double() - reference).norm() <= 2e-2 * reference.norm()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_without_a_fused_kernel_matches_the_formula(causal):
    """`plain_attention_with_lse`, a blockwise chunk's attention per block on a device with no fused kernel returning
    its log-sum-exp (MPS, ...): the output and log-sum-exp of the float64 softmax (queries over their own keys
    causally, top-left aligned, or over other keys), fp32 and bf16."""
    gen = torch.Generator().manual_seed(2)
    rows, keys = (5, 5) if causal else (4, 7)
    query, key, value = (torch.randn(2, 3, n, 6, generator=gen) for n in (rows, keys, keys))
    scores = query.double() @ key.double().transpose(-1, -2) * 0.4
    if causal:
        scores = scores.masked_fill(~torch.ones(rows, keys, dtype=torch.bool).tril(), float("-inf"))
    want_lse = scores.logsumexp(-1)
    want = scores.softmax(-1) @ value.double()
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        out, lse = mla_context.plain_attention_with_lse(query.to(dtype), key.to(dtype), value.to(dtype), causal, 0.4)
        assert out.dtype == dtype and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


def test_attention_backward_without_a_fused_kernel_matches_the_formula():
    """`plain_attention_backward`, the context attention operator's backward per key block on a device with no fused
    kernel backward (CUDA, MPS): given the output and log-sum-exp merged over every block (the queries over their own
    keys causally, then two blocks of other keys), each block's ``dq`` (summed over the blocks), ``dk`` and ``dv``
    are autograd's through the float64 softmax over all the keys."""
    gen = torch.Generator().manual_seed(4)
    rows, sizes = 5, (5, 7, 3)
    query = torch.randn(2, 3, rows, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(2, 3, n, 6, generator=gen, dtype=torch.float64, requires_grad=True) for n in sizes]
    values = [torch.randn(2, 3, n, 6, generator=gen, dtype=torch.float64, requires_grad=True) for n in sizes]
    scores = query @ torch.cat(keys, 2).transpose(-1, -2) * 0.4
    own = torch.ones(rows, sum(sizes), dtype=torch.bool)
    own[:, : rows] = torch.ones(rows, rows, dtype=torch.bool).tril()
    scores = scores.masked_fill(~own, float("-inf"))
    out = scores.softmax(-1) @ torch.cat(values, 2)
    probe = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(out, [query, *keys, *values], probe)
    lse = scores.detach().logsumexp(-1)
    d_query = 0  # (in fp32: its logits are fp32 whatever the inputs)
    for index, (key, value) in enumerate(zip(keys, values)):
        dq, dk, dv = mla_context.plain_attention_backward(*(x.detach().float() for x in (probe, query, key, value, out,
                                                                                           lse)), index == 0, 0.4)
        d_query = d_query + dq.double()
        torch.testing.assert_close(dk.double(), want[1 + index], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dv.double(), want[4 + index], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(d_query, want[0], atol=1e-5, rtol=1e-5)


def test_a_chunk_with_autograd_and_a_mask_matches_the_formula():
    """With the caller's causal mask (eager's route) the chunk under autograd is expanded and masked; the same
    gradients."""
    layer = k3_layer("eager")
    x = hidden(1, 30, layer.config.hidden_size, seed=5).requires_grad_()
    cache = KimiK3HybridCache(layer.config)
    with torch.no_grad():
        first = layer(x[:, :10].detach(), attention_mask=additive_causal(10, 10), past_key_values=cache)[0]
    chunk = layer(x[:, 10:], attention_mask=additive_causal(20, 30), past_key_values=cache)[0]
    probe = torch.randn(chunk.shape, generator=torch.Generator().manual_seed(6))
    (chunk * probe).sum().backward()
    x64 = x.detach().double().requires_grad_()
    want = reference_mla(layer, x64)
    (want[:, 10:] * probe.double()).sum().backward()
    torch.testing.assert_close(torch.cat([first, chunk.detach()], 1).double(), want.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad[:, 10:].double(), x64.grad[:, 10:], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# Against transformers' in-tree Kimi Linear MLA
def in_tree_pair(implementation: str) -> tuple[KimiLinearAttention, KimiK3MLA]:
    """transformers' ``KimiLinearAttention`` with random weights, and K3's layer with those weights (the same
    names: the checkpoint layout), from matching configs (K3's output gate off, latent norms at Kimi Linear's eps)."""
    kl_config = kimi_linear_config()
    kl_config._attn_implementation = implementation
    reference = KimiLinearAttention(kl_config, layer_idx=0).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(7)
        for name, param in reference.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else 0.08
            param.copy_((1.0 if name.endswith("norm.weight") else 0.0) + scale * torch.randn(param.shape, generator=gen))
    k3_config = k3_config_matching(kl_config)
    k3_config._attn_implementation = implementation
    layer = KimiK3MLA(k3_config, k3_config.layer_types.index("full_attention")).eval()
    layer.load_state_dict(reference.state_dict(), strict=True)
    return reference, layer


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_prefill_matches_in_tree_kimi_linear(implementation):
    reference, layer = in_tree_pair(implementation)
    x = hidden(2, 11, layer.config.hidden_size, seed=8)
    mask = additive_causal(11, 11)
    with torch.no_grad():
        want = reference(x, mask)[0]
        got = layer(x, attention_mask=mask)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), reference_mla(layer, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no-mask"])
def test_steps_on_a_cache_match_in_tree_kimi_linear(implementation, masked):
    """Prefill, three decode steps, a chunk of 2 and one of 20, on K3's cache and on transformers' DynamicCache."""
    reference, layer = in_tree_pair(implementation)
    splits = (6, 1, 1, 1, 2, 20)
    x = hidden(1, sum(splits), layer.config.hidden_size, seed=9)
    theirs = DynamicCache()
    want, start = [], 0
    with torch.no_grad():
        for size in splits:
            want.append(reference(x[:, start:start + size], additive_causal(size, start + size), theirs)[0])
            start += size
        got = steps_on_a_cache(layer, x, splits, masked)
    torch.testing.assert_close(got, torch.cat(want, 1), atol=2e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# In the model: padded rows, the flash-attention family's 2-D mask, a chunk decided on another device
@pytest.fixture
def implementation(model):
    """Sets ``config._attn_implementation`` for a test and restores it."""
    before = model.config._attn_implementation

    def use(name):
        model.config._attn_implementation = name

    yield use
    model.config._attn_implementation = before


# flash_attention_2 / 3 run on CPU here as far as MLA goes: a decode step of <= 16 tokens after a cache attends in
# latent space, which never calls flash-attn; transformers then hands the layers its 2-D [B, S] padding mask
@pytest.mark.parametrize("attention", ["flash_attention_2", "flash_attention_3", "eager", "sdpa"])
@pytest.mark.parametrize("new_tokens", [1, 2, 3, 16])
def test_padded_decode_equals_the_unpadded_rows(model, implementation, attention, new_tokens):
    gen = torch.Generator().manual_seed(new_tokens)
    ids = torch.randint(3, 400, (2, 6), generator=gen)
    new = torch.randint(3, 400, (2, new_tokens), generator=gen)
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        implementation("sdpa")
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        alone = [model(torch.cat([ids[:1], new[:1]], 1)).logits[:, -new_tokens:],
                 model(torch.cat([ids[1:, 2:], new[1:]], 1)).logits[:, -new_tokens:]]
        implementation(attention)
        step = model(new, attention_mask=torch.cat([mask, torch.ones(2, new_tokens, dtype=torch.long)], 1),
                     past_key_values=cache).logits
    torch.testing.assert_close(step[:1], alone[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(step[1:], alone[1], atol=2e-5, rtol=1e-5)


def test_padded_rows_match_the_float64_formula():
    """A left-padded row through prefill and decode steps: its tokens are the formula's with the padding masked."""
    layer = k3_layer("eager")
    x = hidden(2, 9, layer.config.hidden_size, seed=10)
    padding = torch.tensor([[1] * 9, [0, 0, 0] + [1] * 6])
    want = reference_mla(layer, x, padding)
    cache = KimiK3HybridCache(layer.config)
    outs, start = [], 0
    with torch.no_grad():
        for size in (5, 1, 3):
            keep = additive_causal(size, start + size) == 0
            keep = keep & padding[:, None, None, : start + size].bool()
            outs.append(layer(x[:, start:start + size], attention_mask=keep, past_key_values=cache)[0])
            start += size
    got = torch.cat(outs, 1).double()
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], atol=2e-5, rtol=1e-5)  # (padding slots: any value)


def test_the_2d_padding_mask_is_causal_aligned_to_the_end():
    scores = torch.zeros(2, 1, 3, 5)
    out = mla._apply_mask(scores, torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]))
    kept = out > torch.finfo(out.dtype).min
    assert kept[0, 0].tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]
    assert kept[1, 0].tolist() == [[False, True, True, False, False], [False, True, True, True, False],
                                   [False] + [True] * 4]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_chunk_after_the_cache_equals_one_forward(model, implementation, attention):
    """The model drops the [T, context] mask when it expects the layers' blockwise path (CPU SDPA). (A layer that
    decides otherwise, on another device, gets no mask and attends causally to the cache's end: the no-mask steps
    above.)"""
    implementation(attention)
    ids = torch.randint(3, 400, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        cache = model(ids[:, :6], use_cache=True).past_key_values
        chunk = model(ids[:, 6:], past_key_values=cache).logits  # 24 tokens: more than the latent-space path takes
    torch.testing.assert_close(chunk, full[:, 6:], atol=2e-5, rtol=1e-5)


def _efficient_attention_like_cuda(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                                   is_causal=False, *, scale=None):
    """CUDA's memory-efficient kernel as its schema and PyTorch's kernel give it, in plain math on the CPU: the
    output, and the log-sum-exp with its rows padded to a multiple of 32 (garbage in the padding)."""
    assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0
    scores = query.float() @ key.float().transpose(-1, -2) * scale
    if is_causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp() @ value.float()
    rows = -(-query.shape[-2] // 32) * 32
    padded = torch.full((*lse.shape[:-1], rows), 123.0)
    padded[..., : lse.shape[-1]] = lse
    return out.to(query.dtype), padded, torch.empty(()), torch.empty(())


def test_the_blockwise_chunk_through_cudas_log_sum_exp_kernel(long_context, monkeypatch):
    """On CUDA a chunk after cached tokens attends blockwise too (expanding K/V for the whole context would not fit
    at long contexts), through the memory-efficient kernel's log-sum-exp, whose rows come padded to a multiple of 32.
    Emulated: that kernel's documented outputs in plain math, behind the CUDA wrapper; the chunk is the formula's."""
    layer, x, prefilled = long_context
    like_cuda = functools.partial(mla_context._cuda_efficient_attention, kernel=_efficient_attention_like_cuda)
    # why: CUDA's kernel (no GPU here) as its documented outputs, on CPU tensors, behind the CUDA wrapper
    monkeypatch.setitem(mla_context.LSE_KERNELS, "cpu", like_cuda)
    with torch.no_grad():
        chunk = layer(x[:, -24:], past_key_values=copy.deepcopy(prefilled))[0]
    torch.testing.assert_close(chunk.double(), reference_mla(layer, x, last=24), atol=2e-5, rtol=1e-5)
