"""Router, experts, dense MLP and the Stable Latent MoE (spec 6.2, 6.3 and 11.1 items 8 and 9)."""

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from transformers_k3.modeling_kimi_k3 import K3_GROUPED_MM, KimiK3Experts, KimiK3MLP, KimiK3Router, KimiK3SparseMoE
from transformers_k3.ops import cpu_kernel
from transformers_k3.ops import experts as experts_module
from transformers_k3.ops.kernel_layers import kernelize

from references import make_config, make_moe, modules_path, randomize, ref_experts, ref_glu, ref_moe

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm", K3_GROUPED_MM)


@pytest.fixture(params=["grouped", "gathered", "fused", "fused_sgemm"])
def k3_path(request):
    """`k3_grouped_mm` has these paths on CPU: with the experts' kernel attached (`kernelize`, see `on_path`) the
    fused C++ kernel (fp32, forward and backward; for small experts on AVX-512 or AVX2 its own register-blocked
    products, else sgemm: "fused_sgemm" asks for the latter), and without it the grouped GEMM and (for few
    assignments) gathered expert weights; the tests that take this fixture run it once on each."""
    if request.param.startswith("fused") and cpu_kernel.library() is None:
        pytest.skip(f"fused CPU kernels unavailable: {cpu_kernel.load_error()}")
    return request.param


def on_path(experts, k3_path):
    """``experts`` computing on the path `k3_path` names, through their kernel slot (what ``"k3_grouped_mm"``
    calls): the fused kernel as `kernelize` attaches it, that kernel on sgemm whatever the shape, or one PyTorch
    path (gathered weights or the grouped GEMM) whatever the shape."""
    if k3_path == "fused":
        return kernelize(experts)
    if k3_path == "fused_sgemm":
        kernelize(experts)
        experts.kernel = functools.partial(experts_module.cpu_kernel_experts_forward, small_gemm=False)
        return experts
    limit = 1e18 if k3_path == "gathered" else -1

    def pytorch_path(self, hidden_states, top_k_index, top_k_weights):
        return experts_module.torch_grouped_experts(self, hidden_states, top_k_index, top_k_weights,
                                                    getattr(self, "_is_expert_parallel", False), limit)

    experts.kernel = pytorch_path
    return experts


def inputs(*shape, seed=100, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------------


def make_router(seed=0, **overrides):
    cfg = make_config(**overrides)
    return cfg, randomize(KimiK3Router(cfg), seed)


def test_router_shapes_dtypes_and_persistent_bias():
    cfg, router = make_router()
    x = inputs(3, 5, cfg.hidden_size)
    logits, weights, idx = router(x)
    assert logits.shape == (15, 8) and logits.dtype == torch.float32
    assert weights.shape == (15, 2) and weights.dtype == torch.float32
    assert idx.shape == (15, 2) and idx.dtype == torch.int64
    assert router.weight.shape == (8, 64)
    assert router.e_score_correction_bias.dtype == torch.float32
    state = router.state_dict()
    assert set(state) == {"weight", "e_score_correction_bias"}
    fresh = KimiK3Router(cfg)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.e_score_correction_bias, router.e_score_correction_bias)


def test_router_logits_are_fp32_for_bf16_inputs_and_router_fp32_keeps_fp32_weight():
    cfg, router = make_router()
    router = router.bfloat16()
    x = inputs(7, cfg.hidden_size).bfloat16()
    logits, weights, _ = router(x)
    assert logits.dtype == weights.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ router.weight.float().T)
    assert KimiK3Router(make_config(router_fp32=True)).weight.dtype == torch.float32


def test_loading_in_bf16_keeps_the_selection_bias_and_an_fp32_router_in_fp32(tmp_path, tiny_config):
    """from_pretrained(dtype=bf16) keeps the selection bias in fp32 with its values: a bf16 copy would round Quantile
    Balancing's small updates away (1 + 1e-4 is 1 in bf16). With router_fp32 the weight stays fp32 too. A later
    model.to(bf16) casts them, as transformers' `_keep_in_fp32_modules_strict` does for every model."""
    from transformers import AutoModelForCausalLM

    from transformers_k3 import KimiK3ForCausalLM

    tiny_config.router_fp32 = True
    model = KimiK3ForCausalLM(tiny_config)
    routers = [m for m in model.modules() if isinstance(m, KimiK3Router)]
    assert routers
    with torch.no_grad():
        for router in routers:
            router.e_score_correction_bias.copy_(1 + torch.linspace(-1e-4, 1e-4, router.num_experts))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    loaded_routers = [m for m in loaded.modules() if isinstance(m, KimiK3Router)]
    for router, saved in zip(loaded_routers, routers, strict=True):
        assert router.e_score_correction_bias.dtype == router.weight.dtype == torch.float32
        assert torch.equal(router.e_score_correction_bias, saved.e_score_correction_bias)
        assert torch.equal(router.weight, saved.weight)
    cast = loaded.to(torch.bfloat16)
    assert all(r.e_score_correction_bias.dtype == torch.bfloat16 for r in cast.modules() if isinstance(r, KimiK3Router))


def test_router_selects_k_distinct_experts_and_weights_sum_to_scaling_factor():
    cfg, router = make_router(num_experts=16, num_experts_per_tok=4)
    _, weights, idx = router(inputs(200, cfg.hidden_size))
    assert all(len(set(row)) == 4 for row in idx.tolist())
    assert ((idx >= 0) & (idx < 16)).all()
    torch.testing.assert_close(weights.sum(-1), torch.full((200,), 2.5), atol=1e-6, rtol=0)


def test_router_selection_is_biased_topk_and_weights_are_unbiased_scores():
    cfg, router = make_router(num_experts=16, num_experts_per_tok=4)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(9)) * 0.3)
    logits, weights, idx = router(inputs(200, cfg.hidden_size))
    scores = torch.sigmoid(logits)
    expected = torch.topk(scores + router.e_score_correction_bias, 4, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, expected.sort(-1).values)
    chosen = scores.gather(1, idx)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * 2.5, atol=1e-6, rtol=1e-6)
    # the bias matters for the selection on this data
    assert not torch.equal(idx.sort(-1).values, torch.topk(scores, 4, dim=-1).indices.sort(-1).values)


def test_router_without_renormalisation_uses_raw_scores():
    cfg, router = make_router(moe_renormalize=False)
    logits, weights, idx = router(inputs(50, cfg.hidden_size))
    torch.testing.assert_close(weights, torch.sigmoid(logits).gather(1, idx) * 2.5)


def test_router_softmax_scoring():
    cfg, router = make_router(moe_router_activation_func="softmax", num_experts_per_tok=3)
    logits, weights, idx = router(inputs(50, cfg.hidden_size))
    probs = torch.softmax(logits, -1)
    expected = torch.topk(probs + router.e_score_correction_bias, 3, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, expected.sort(-1).values)
    chosen = probs.gather(1, idx)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * 2.5)


def test_large_bias_forces_selection_without_changing_the_other_weights_ratios():
    cfg, router = make_router(num_experts=16, num_experts_per_tok=4)
    x = inputs(100, cfg.hidden_size)
    logits, w0, idx0 = router(x)
    with torch.no_grad():
        router.e_score_correction_bias[5] = 100.0
    _, w1, idx1 = router(x)
    assert (idx1 == 5).any(-1).all()
    scores = torch.sigmoid(logits)
    for t in range(100):
        old = dict(zip(idx0[t].tolist(), w0[t].tolist()))
        new = dict(zip(idx1[t].tolist(), w1[t].tolist()))
        others = [e for e in new if e != 5]
        assert len(others) == 3
        # every pair keeps the ratio of its unbiased scores, the forced expert included
        for e in new:
            assert new[e] / new[others[0]] == pytest.approx((scores[t, e] / scores[t, others[0]]).item(), rel=1e-5)
        # experts selected in both runs keep their mutual ratios
        common = [e for e in others if e in old]
        for e in common[1:]:
            assert new[e] / new[common[0]] == pytest.approx(old[e] / old[common[0]], rel=1e-5)


@pytest.mark.parametrize("topk_group", [1, 2])
def test_grouped_routing_picks_only_from_kept_groups(topk_group):
    cfg, router = make_router(num_experts=16, num_experts_per_tok=3, num_expert_group=4, topk_group=topk_group)
    x = inputs(300, cfg.hidden_size)
    logits, weights, idx = router(x)
    biased = torch.sigmoid(logits) + router.e_score_correction_bias
    group_scores = biased.view(300, 4, 4).topk(2, dim=-1).values.sum(-1)
    kept = group_scores.topk(topk_group, dim=-1).indices
    for t in range(300):
        assert set((idx[t] // 4).tolist()) <= set(kept[t].tolist())
        allowed = [e for e in range(16) if e // 4 in kept[t].tolist()]
        best = sorted(allowed, key=lambda e: -biased[t, e].item())[:3]
        assert sorted(idx[t].tolist()) == sorted(best)
    torch.testing.assert_close(weights.sum(-1), torch.full((300,), 2.5), atol=1e-6, rtol=0)
    # on this data the group limit changes some selections
    free = torch.topk(biased, 3, dim=-1).indices.sort(-1).values
    assert not torch.equal(idx.sort(-1).values, free)


def test_router_matches_transformers_kimi_linear_router():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

    cfg, router = make_router(num_experts=16, num_experts_per_tok=4, num_expert_group=4, topk_group=2)
    hf_cfg = SimpleNamespace(
        num_experts_per_tok=4, num_local_experts=16, hidden_size=64, routed_scaling_factor=2.5,
        n_group=4, topk_group=2, norm_topk_prob=True,
    )
    hf = KimiLinearTopkRouter(hf_cfg)
    hf.load_state_dict(router.state_dict())
    x = inputs(64, cfg.hidden_size)
    ours, theirs = router(x), hf(x)
    torch.testing.assert_close(ours[0], theirs[0], atol=0, rtol=0)
    o_idx, o_order = ours[2].sort(-1)
    t_idx, t_order = theirs[2].sort(-1)
    assert torch.equal(o_idx, t_idx)
    torch.testing.assert_close(ours[1].gather(1, o_order), theirs[1].gather(1, t_order), atol=1e-7, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------
# Experts and MLP
# ----------------------------------------------------------------------------------------------------


def test_expert_shapes_and_layout():
    cfg = make_config()
    experts = KimiK3Experts(cfg)
    assert experts.gate_up_proj.shape == (8, 64, 32)  # [E, 2I, D] with D = routed_expert_hidden_size
    assert experts.down_proj.shape == (8, 32, 32)  # [E, D, I]
    flat = KimiK3Experts(make_config(routed_expert_hidden_size=None))
    assert flat.gate_up_proj.shape == (8, 64, 64) and flat.down_proj.shape == (8, 64, 32)


def test_gate_rows_come_first_in_gate_up_proj():
    cfg = make_config(num_experts=2)
    experts = randomize(KimiK3Experts(cfg))
    x = inputs(5, 32)
    idx = torch.zeros(5, 2, dtype=torch.long)
    idx[:, 1] = 1
    w = torch.ones(5, 2)
    out = experts(x, idx, w)
    i = cfg.moe_intermediate_size
    ref = sum(
        F.linear(ref_glu(x @ experts.gate_up_proj[e, :i].T, x @ experts.gate_up_proj[e, i:].T, cfg), experts.down_proj[e])
        for e in range(2)
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hidden_act", ["situ", "silu"])
@pytest.mark.parametrize("latent", [32, None])
def test_experts_implementations_agree(hidden_act, latent, k3_path):
    cfg = make_config(hidden_act=hidden_act, routed_expert_hidden_size=latent, num_experts=16, num_experts_per_tok=4)
    experts = on_path(randomize(KimiK3Experts(cfg)), k3_path)
    d = experts.hidden_dim
    x = inputs(37, d)
    gen = torch.Generator().manual_seed(3)
    # expert 3 is never hit; some experts get many tokens
    idx = torch.stack([torch.randperm(15, generator=gen)[:4] for _ in range(37)])
    idx = torch.where(idx >= 3, idx + 1, idx)
    w = torch.rand(37, 4, generator=gen)
    outs, grads = {}, {}
    for impl in IMPLEMENTATIONS:
        cfg._experts_implementation = impl
        experts.zero_grad()
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = experts(xi, idx, wi)
        (out * torch.linspace(-1, 1, d)).sum().backward()
        outs[impl] = out.detach()
        grads[impl] = (xi.grad, wi.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone())
    for impl in IMPLEMENTATIONS[1:]:
        torch.testing.assert_close(outs[impl], outs["eager"], atol=1e-5, rtol=1e-5)
        for g, g_ref in zip(grads[impl], grads["eager"]):
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(grads["eager"][2][3]) == 0  # the expert that was not hit gets no gradient


def test_experts_eager_matches_a_per_token_loop_and_handles_edge_cases():
    cfg = make_config()
    experts = randomize(KimiK3Experts(cfg))
    x = inputs(9, 32)
    idx = torch.tensor([[0, 7]] * 4 + [[7, 0]] * 3 + [[2, 3]] * 2)
    w = torch.rand(9, 2, generator=torch.Generator().manual_seed(1))
    out = experts(x, idx, w)
    i = cfg.moe_intermediate_size
    for t in range(9):
        ref = torch.zeros(32)
        for j in range(2):
            e = idx[t, j]
            h = ref_glu(experts.gate_up_proj[e, :i] @ x[t], experts.gate_up_proj[e, i:] @ x[t], cfg)
            ref = ref + w[t, j] * (experts.down_proj[e] @ h)
        torch.testing.assert_close(out[t], ref, atol=1e-5, rtol=1e-5)
    # no tokens
    empty = experts(x[:0], idx[:0], w[:0])
    assert empty.shape == (0, 32)
    # expert-parallel sentinels (id == num_experts, weight 0) contribute nothing
    experts._is_expert_parallel = True  # what transformers sets under expert parallelism
    sentinel_idx = torch.cat([idx, torch.full((9, 1), 8)], dim=1)
    sentinel_w = torch.cat([w, torch.zeros(9, 1)], dim=1)
    torch.testing.assert_close(experts(x, sentinel_idx, sentinel_w), out)


def experts_case(case):
    """(num_tokens, top_k, idx) for the named routing case; 16 experts, expert 3 never hit."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, top_k = {"many": (37, 4), "single_token": (1, 4), "top1": (20, 1)}[case]
    idx = torch.stack([torch.randperm(15, generator=gen)[:top_k] for _ in range(num_tokens)])
    return num_tokens, top_k, torch.where(idx >= 3, idx + 1, idx)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", ["many", "single_token", "top1"])
def test_experts_outputs_and_gradients_match_the_per_token_loop(impl, case, k3_path):
    cfg = make_config(num_experts=16, _experts_implementation=impl)
    experts = on_path(randomize(KimiK3Experts(cfg)), k3_path)
    num_tokens, top_k, idx = experts_case(case)
    x = inputs(num_tokens, 32).requires_grad_()
    w = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(4)).requires_grad_()
    probe = inputs(num_tokens, 32, seed=5)
    out = experts(x, idx, w)
    (out * probe).sum().backward()
    ref_out, ref_grads = ref_experts(experts, x, idx, w, probe)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    grads = (x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad)
    for name, g, g_ref in zip(("x", "weights", "gate_up_proj", "down_proj"), grads, ref_grads):
        torch.testing.assert_close(g.double(), g_ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    hit = torch.zeros(16, dtype=torch.bool)
    hit[idx.unique()] = True
    assert not hit[3] and (experts.gate_up_proj.grad[~hit] == 0).all() and (experts.down_proj.grad[~hit] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_experts_kernel_decode_step_matches_the_per_token_loop(dtype):
    """Up to 4 tokens without autograd the experts kernel runs each assignment's products as dot products over the
    stored weights (no transposed copies): the float64 per-token loop's output (fp32: 1e-5; bf16: the kernel's
    fp32 result rounded once, so within a bf16 rounding), the same bits with 1, 2 or 3 threads, sentinel ids
    (expert parallelism) contributing nothing, odd widths; 5 tokens take the other paths, to the same values."""
    if cpu_kernel.library() is None or not cpu_kernel.library().small_gemm_available():
        pytest.skip("the experts kernel's vector paths are unavailable (no AVX-512 or AVX2)")
    # (bf16: the kernel's fp32 result, rounded once)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=8e-3)

    def on_threads(experts, x, idx, w):  # the kernel's output, the same bits on 1, 2 and 3 threads
        outs, before = [], torch.get_num_threads()
        try:
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)  # (more threads than cores still runs that many workers)
                with torch.no_grad():
                    outs.append(cpu_kernel.moe_experts(x, idx, w, experts.gate_up_proj, experts.down_proj, False,
                                                       experts.glu))  # fmt: skip
        finally:
            torch.set_num_threads(before)
        assert all(torch.equal(o, outs[0]) for o in outs[1:]) and outs[0].dtype == dtype
        return outs[0]

    cfg = make_config(num_experts=13, routed_expert_hidden_size=40, moe_intermediate_size=20,
                      _experts_implementation=K3_GROUPED_MM)  # fmt: skip
    experts = randomize(KimiK3Experts(cfg)).to(dtype)
    gen = torch.Generator().manual_seed(7)
    for n in (1, 2, 4, 5):
        idx = torch.stack([torch.randperm(13, generator=gen)[:5] for _ in range(n)])
        idx[0, 2] = 13  # a sentinel: another rank's expert (zero weight there; here any weight is dropped)
        w = torch.rand(n, 5, generator=gen)
        x = inputs(n, 40, seed=n).to(dtype)
        out = on_threads(experts, x, idx, w)
        kept = torch.where(idx < 13, idx, 0)
        ref, _ = ref_experts(experts, x, kept, torch.where(idx < 13, w, 0.0), torch.zeros(n, 40))
        torch.testing.assert_close(out.double(), ref, **tolerance)
    # wide enough for several threads (a thread per 2M multiply-adds: here 4 x 16 x 3 x 256 x 192 = 9.4M)
    cfg = make_config(num_experts=20, routed_expert_hidden_size=256, moe_intermediate_size=192,
                      _experts_implementation=K3_GROUPED_MM)  # fmt: skip
    experts = randomize(KimiK3Experts(cfg)).to(dtype)
    idx = torch.stack([torch.randperm(20, generator=gen)[:16] for _ in range(4)])
    w, x = torch.rand(4, 16, generator=gen), inputs(4, 256, seed=9).to(dtype)
    ref, _ = ref_experts(experts, x, idx, w, torch.zeros(4, 256))
    torch.testing.assert_close(on_threads(experts, x, idx, w).double(), ref, **tolerance)


def test_k3_grouped_mm_drops_expert_parallel_sentinels_and_handles_no_tokens(k3_path):
    cfg = make_config(_experts_implementation=K3_GROUPED_MM)
    experts = on_path(randomize(KimiK3Experts(cfg)), k3_path)
    x = inputs(9, 32)
    idx = torch.tensor([[0, 7]] * 4 + [[7, 0]] * 3 + [[2, 3]] * 2)
    w = torch.rand(9, 2, generator=torch.Generator().manual_seed(1))
    runs = []
    for ids, weights in ((idx, w), (torch.cat([idx, torch.full((9, 1), 8)], 1), torch.cat([w, torch.zeros(9, 1)], 1))):
        experts._is_expert_parallel = ids.shape[1] == 3  # transformers sets it under expert parallelism
        experts.zero_grad()
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = experts(xi, ids, wi)
        out.sum().backward()
        runs.append((out, xi.grad, wi.grad, experts.gate_up_proj.grad.clone()))
    (out, *grads), (sentinel_out, *sentinel_grads) = runs
    torch.testing.assert_close(sentinel_out, out)
    torch.testing.assert_close(sentinel_grads[1][:, :2], grads[1])
    assert (sentinel_grads[1][:, 2] == 0).all()
    for g, g_ref in zip(sentinel_grads[::2], grads[::2]):
        torch.testing.assert_close(g, g_ref)
    empty = experts(x[:0].requires_grad_(), idx[:0], w[:0])
    assert empty.shape == (0, 32)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_experts_keep_the_input_dtype(impl, k3_path):
    cfg = make_config(_experts_implementation=impl)
    experts = on_path(randomize(KimiK3Experts(cfg)).bfloat16(), k3_path)
    x = inputs(6, 32).bfloat16()
    idx = torch.tensor([[0, 1]] * 6)
    out = experts(x, idx, torch.rand(6, 2))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_experts_silu_match_transformers_kimi_linear_experts():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearExperts

    cfg = make_config(hidden_act="silu", routed_expert_hidden_size=None)
    ours = randomize(KimiK3Experts(cfg))
    hf_cfg = SimpleNamespace(
        num_local_experts=8, hidden_size=64, moe_intermediate_size=32, hidden_act="silu",
        _experts_implementation="eager",
    )
    theirs = KimiLinearExperts(hf_cfg)
    theirs.load_state_dict(ours.state_dict())
    x = inputs(20, 64)
    idx = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(t))[:2] for t in range(20)])
    w = torch.rand(20, 2)
    torch.testing.assert_close(ours(x, idx, w), theirs(x, idx, w), atol=1e-6, rtol=1e-6)


def test_apply_gate_is_the_configured_glu():
    cfg = make_config()
    experts = KimiK3Experts(cfg)
    gate_up = inputs(4, 64) * 10
    gate, up = gate_up[:, :32], gate_up[:, 32:]
    torch.testing.assert_close(experts._apply_gate(gate_up), ref_glu(gate, up, cfg))
    silu = make_config(hidden_act="silu")
    torch.testing.assert_close(KimiK3Experts(silu)._apply_gate(gate_up), ref_glu(gate, up, silu))


@pytest.mark.parametrize("hidden_act", ["situ", "silu"])
def test_mlp_matches_formula(hidden_act):
    cfg = make_config(hidden_act=hidden_act)
    mlp = randomize(KimiK3MLP(cfg))
    assert mlp.gate_proj.weight.shape == (128, 64) and mlp.down_proj.weight.shape == (64, 128)
    assert mlp.gate_proj.bias is None
    x = inputs(2, 3, 64)
    ref = F.linear(ref_glu(F.linear(x, mlp.gate_proj.weight), F.linear(x, mlp.up_proj.weight), cfg), mlp.down_proj.weight)
    torch.testing.assert_close(mlp(x), ref, atol=1e-5, rtol=1e-5)
    assert KimiK3MLP(cfg, intermediate_size=48, hidden_size=16).up_proj.weight.shape == (48, 16)


def test_bad_hidden_act_raises():
    with pytest.raises(ValueError, match="hidden_act"):
        KimiK3MLP(make_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="hidden_act"):
        KimiK3SparseMoE(make_config(hidden_act="gelu"))


# ----------------------------------------------------------------------------------------------------
# Sparse MoE
# ----------------------------------------------------------------------------------------------------


def test_moe_parameter_names_and_shapes():
    cfg, moe = make_moe()
    shapes = {k: tuple(v.shape) for k, v in moe.state_dict().items()}
    assert shapes == {
        "gate.weight": (8, 64),
        "gate.e_score_correction_bias": (8,),
        "experts.gate_up_proj": (8, 64, 32),
        "experts.down_proj": (8, 32, 32),
        "routed_expert_down_proj.weight": (32, 64),
        "routed_expert_norm.weight": (32,),
        "routed_expert_up_proj.weight": (64, 32),
        "shared_experts.gate_proj.weight": (32, 64),
        "shared_experts.up_proj.weight": (32, 64),
        "shared_experts.down_proj.weight": (64, 32),
    }
    assert moe.routed_expert_norm.variance_epsilon == cfg.rms_norm_eps
    two_shared = KimiK3SparseMoE(make_config(num_shared_experts=2))
    assert two_shared.shared_experts.gate_proj.weight.shape == (64, 64)
    no_norm = KimiK3SparseMoE(make_config(latent_moe_use_norm=False)).state_dict()
    assert "routed_expert_norm.weight" not in no_norm and "routed_expert_down_proj.weight" in no_norm
    flat = KimiK3SparseMoE(make_config(routed_expert_hidden_size=None, num_shared_experts=0)).state_dict()
    assert set(flat) == {"gate.weight", "gate.e_score_correction_bias", "experts.gate_up_proj", "experts.down_proj"}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"latent_moe_use_norm": False},
        {"routed_expert_hidden_size": None},
        {"routed_expert_hidden_size": None, "num_shared_experts": 0},
        {"num_shared_experts": 2, "num_experts_per_tok": 3},
        {"num_experts": 16, "num_experts_per_tok": 3, "num_expert_group": 4, "topk_group": 2},
        {"moe_router_activation_func": "softmax", "moe_renormalize": False},
        {"hidden_act": "silu"},
        {"activation_situ_linear_beta": None},
    ],
    ids=["latent", "latent_no_norm", "non_latent", "non_latent_no_shared", "two_shared", "grouped", "softmax", "silu",
         "no_linear_cap"],
)
def test_moe_matches_per_token_reference(overrides):
    cfg, moe = make_moe(**overrides)
    x = inputs(3, 7, cfg.hidden_size)
    out = moe(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_moe(moe, x, cfg), atol=1e-5, rtol=1e-5)
    # [N, H] input gives the same rows
    torch.testing.assert_close(moe(x.reshape(-1, cfg.hidden_size)), out.reshape(-1, cfg.hidden_size))


def test_latent_norm_cancels_the_routed_scaling_factor():
    cfg, moe = make_moe()
    x = inputs(4, 16, cfg.hidden_size)
    out = moe(x)
    moe.gate.routed_scaling_factor *= 10
    rel = (moe(x) - out).norm() / out.norm()
    assert 0 < rel < 1e-3
    # without the latent norm the factor is not cancelled
    cfg, moe = make_moe(latent_moe_use_norm=False)
    out = moe(x)
    moe.gate.routed_scaling_factor *= 10
    assert (moe(x) - out).norm() / out.norm() > 0.1


@pytest.mark.parametrize("latent", [32, None])
def test_moe_implementations_agree(latent, k3_path):
    cfg, moe = make_moe(routed_expert_hidden_size=latent, num_experts=16, num_experts_per_tok=4)
    on_path(moe.experts, k3_path)
    x = inputs(2, 9, cfg.hidden_size)
    outs, grads = {}, {}
    for impl in IMPLEMENTATIONS:
        cfg._experts_implementation = impl
        moe.zero_grad()
        xi = x.clone().requires_grad_()
        out = moe(xi)
        (out * torch.linspace(-1, 1, cfg.hidden_size)).sum().backward()
        outs[impl] = out.detach()
        grads[impl] = [xi.grad] + [p.grad.clone() for p in moe.parameters()]
    for impl in IMPLEMENTATIONS[1:]:
        torch.testing.assert_close(outs[impl], outs["eager"], atol=1e-5, rtol=1e-5)
        for g, g_ref in zip(grads[impl], grads["eager"]):
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


def test_backward_reaches_router_experts_and_latent_projections():
    cfg, moe = make_moe(num_experts=16, num_experts_per_tok=4)
    x = inputs(2, 5, cfg.hidden_size)
    _, _, idx = moe.gate(x)
    (moe(x) * torch.linspace(-1, 1, cfg.hidden_size)).sum().backward()
    # sigmoid routing: the router learns through the top-k weights
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    hit = torch.zeros(16, dtype=torch.bool)
    hit[idx.unique()] = True
    per_expert = moe.experts.gate_up_proj.grad.abs().sum(dim=(1, 2))
    assert (per_expert[hit] > 0).all() and (per_expert[~hit] == 0).all()
    assert (moe.experts.down_proj.grad.abs().sum(dim=(1, 2))[hit] > 0).all()
    for name, p in moe.named_parameters():
        if not name.startswith("experts."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert moe.gate.e_score_correction_bias.grad is None


def test_moe_runs_in_bf16():
    cfg, moe = make_moe()
    moe = moe.bfloat16()
    x = inputs(2, 4, cfg.hidden_size).bfloat16()
    out = moe(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    ref = ref_moe(moe, x, cfg)
    assert ((out.double() - ref).norm() / ref.norm()) < 2e-2


def test_default_experts_implementation_is_k3_grouped_mm_and_all_are_selectable():
    """Without an explicit `experts_implementation` the model runs `k3_grouped_mm`, the fastest correct one
    (bench/bench_moe.py); an explicit choice, transformers' three included, is kept."""
    import transformers_k3

    model = transformers_k3.KimiK3ForCausalLM(transformers_k3.KimiK3TextConfig.tiny())
    assert model.config._experts_implementation == K3_GROUPED_MM
    experts = model.model.layers[1].mlp.experts
    assert experts.config is model.config
    for impl in ("eager", "batched_mm", "grouped_mm", K3_GROUPED_MM):
        model.set_experts_implementation(impl)
        assert experts.config._experts_implementation == impl
    config = transformers_k3.KimiK3TextConfig.tiny(experts_implementation="grouped_mm")
    assert transformers_k3.KimiK3ForCausalLM(config).config._experts_implementation == "grouped_mm"


def test_k3_grouped_mm_gathers_weights_for_few_assignments(monkeypatch):
    """The PyTorch path's default rule (no kernel attached): a decode step at K3's expert count gathers the 16
    experts' weights (the grouped GEMM would visit all 896 experts; bitwise the gathered products); a 2,048-token
    batch runs the grouped GEMM (bitwise transformers' own grouped GEMM sums, not the gathered products); both
    agree with transformers' "grouped_mm"."""
    cfg = make_config(num_experts=896, num_experts_per_tok=16, routed_expert_hidden_size=32,
                      moe_intermediate_size=8, _experts_implementation=K3_GROUPED_MM)
    experts = randomize(KimiK3Experts(cfg))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tokens in (1, 2048):
            x = inputs(tokens, 32)
            idx = torch.stack([torch.randperm(896, generator=gen)[:16] for _ in range(tokens)])
            w = torch.rand(tokens, 16, generator=gen)
            out = experts(x, idx, w)
            gathered = experts_module._gathered_experts(experts, x, idx, w)
            assert torch.equal(out, gathered) == (tokens == 1)
            cfg._experts_implementation = "grouped_mm"
            torch.testing.assert_close(out, experts(x, idx, w), atol=1e-5, rtol=1e-5)
            cfg._experts_implementation = K3_GROUPED_MM


# ----------------------------------------------------------------------------------------------------
# Decode step: the whole layer in one kernel call (kernelize: KimiK3SparseMoE's kernel, cpu_kernel.MoeDecode)
# ----------------------------------------------------------------------------------------------------


def kernel_moe(**overrides):
    """`make_moe` with the fused kernels attached (`kernelize`)."""
    cfg, moe = make_moe(**overrides)
    return cfg, kernelize(moe)


def decode_kernel_or_skip():
    if cpu_kernel.library() is None or cpu_kernel.moe_decode_max_tokens() == 0:
        pytest.skip("the fused decode step needs the CPU kernels with AVX-512 or AVX2")


def kernel_output(moe, x, grad=False):
    """What the layer's attached decode kernel (its ``kernel`` slot, `MoeDecodeKernel`) returns for ``x``: its
    ``[N, H]`` values, or None where none is attached or it steps aside (then the layer runs its modules)."""
    if moe.kernel is None:
        return None
    with torch.set_grad_enabled(grad):
        return moe.kernel(x.reshape(-1, x.shape[-1]))


def assert_kernel_computes(moe, x, out, cfg, atol=1e-5):
    """The attached decode kernel computes ``x`` (not None), within ``atol`` of the float64 reference, and the
    layer's output ``out`` is its value."""
    got = kernel_output(moe, x)
    assert got is not None
    torch.testing.assert_close(got.double(), ref_moe(moe, x, cfg).reshape(got.shape), atol=atol, rtol=atol)
    assert torch.equal(out.reshape(got.shape), got)


DECODE_CASES = {
    "latent": {},
    "latent_no_norm": {"latent_moe_use_norm": False},
    "non_latent": {"routed_expert_hidden_size": None},
    "non_latent_no_shared": {"routed_expert_hidden_size": None, "num_shared_experts": 0},
    "two_shared_top3": {"num_shared_experts": 2, "num_experts_per_tok": 3},
    "silu": {"hidden_act": "silu"},
    "no_linear_cap": {"activation_situ_linear_beta": None},
    "beta_2": {"activation_situ_beta": 2.0},
    "no_renormalize": {"moe_renormalize": False},
    "top1_of_4": {"num_experts": 4, "num_experts_per_tok": 1},
    "top16_of_40_odd_widths": {"num_experts": 40, "num_experts_per_tok": 16, "hidden_size": 72,
                               "routed_expert_hidden_size": 24, "moe_intermediate_size": 20},
    "router_fp32": {"router_fp32": True},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_step_matches_the_modules_and_the_per_token_reference(case, dtype):
    """A decode step (1-4 tokens, no autograd) runs the whole layer in one kernel call: in fp32 within 1e-5 of the
    float64 per-token reference written from the spec and of the modules (the sums in another order); in bf16
    within 2e-2 of the float64 reference, as the modules are, and the modules' values rounded at the same points:
    with SiTU and the AMX router logits, equal to theirs but where a sum in another order falls on the other side
    of a bf16 rounding tie (about 1 token in 400 in a 1,200-token review sample; none in these inputs, where a
    flip would show as a few ulp), else within a bf16 rounding."""
    decode_kernel_or_skip()
    cfg, moe = kernel_moe(_experts_implementation=K3_GROUPED_MM, **DECODE_CASES[case])
    moe = moe.to(dtype)
    moe.gate.e_score_correction_bias = moe.gate.e_score_correction_bias.float()  # (fp32, as a bf16 load keeps it)
    for n in (1, 2, 4):
        x = inputs(1, n, cfg.hidden_size, seed=100 + n).to(dtype)
        with torch.no_grad():
            out = moe(x)
        assert out.shape == x.shape and out.dtype == dtype
        kernel = kernel_output(moe, x)  # (the layer's value is its kernel's)
        assert kernel is not None and torch.equal(out.reshape(kernel.shape), kernel)
        modules = modules_path(moe, x)
        reference = ref_moe(moe, x, cfg)
        if dtype == torch.float32:
            torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out, modules, atol=1e-6, rtol=1e-5)
        else:
            ulps = ((out.float() - modules.float()).abs() / modules.float().abs().clamp_min(1e-2)).max() * 2**8
            if cpu_kernel.amx_available() and cfg.hidden_act == "situ":
                assert ulps <= 4, ulps  # (a near-tie flip moves the values after it by a few ulp)
            else:
                torch.testing.assert_close(out, modules, atol=2e-2, rtol=1e-2)
            assert ((out.double() - reference).norm() / reference.norm()) < 2e-2


def test_decode_step_reads_the_weights_at_each_call():
    """In-place updates (an optimizer step, Quantile Balancing's bias), replaced parameters and a cast to another
    dtype and back all reach the next decode step."""
    decode_kernel_or_skip()
    cfg, moe = kernel_moe(_experts_implementation=K3_GROUPED_MM)
    x = inputs(1, 1, cfg.hidden_size)
    outs = []

    def step():  # the decode step, checked against the float64 reference on the weights as they are now
        with torch.no_grad():
            outs.append(moe(x))
        torch.testing.assert_close(outs[-1].double(), ref_moe(moe, x, cfg), atol=1e-5, rtol=1e-5)
        assert_kernel_computes(moe, x, outs[-1], cfg)

    step()
    with torch.no_grad():
        moe.experts.down_proj.mul_(2.0)
        moe.gate.e_score_correction_bias.copy_(torch.linspace(5, -5, cfg.num_experts))  # forces the choice
        step()
        moe.routed_expert_up_proj.weight = torch.nn.Parameter(moe.routed_expert_up_proj.weight * -1)
        step()
        moe.bfloat16().float()
        step()
    assert all(not torch.allclose(a, b) for a, b in zip(outs, outs[1:]))


def test_decode_step_steps_aside_where_the_modules_must_run():
    """The modules run (and give their own result) with autograd, more than 4 tokens, a hook on any submodule when
    the kernels are attached (its own or global; a router hook reads the logits), a softmax or grouped router, a
    layer too large for the one-thread kernel, and another submodule class set after `kernelize` (a LoRA layer);
    transformers' experts implementations give the modules' values; no tokens give an empty result."""
    decode_kernel_or_skip()
    cfg, moe = kernel_moe(_experts_implementation=K3_GROUPED_MM)
    x = inputs(1, 3, cfg.hidden_size)
    expected = modules_path(moe, x)

    def check(layer=moe, inp=x, grad=False):  # the kernel steps aside; the layer computes the float64 reference
        assert kernel_output(layer, inp, grad) is None
        with torch.set_grad_enabled(grad):
            out = layer(inp)
        reference = ref_moe(layer, inp, layer.experts.config)
        torch.testing.assert_close(out.detach().double(), reference.reshape(out.shape), atol=1e-5, rtol=1e-5)
        return out

    out = check(grad=True)
    assert out.grad_fn is not None
    torch.testing.assert_close(out.detach(), expected, atol=1e-6, rtol=1e-5)
    check(inp=inputs(1, 5, cfg.hidden_size))
    seen = []
    for module in (moe.gate, moe.experts, moe.routed_expert_norm, moe.shared_experts.down_proj):
        handle = module.register_forward_hook(lambda *args: seen.append(1))
        torch.testing.assert_close(check(kernelize(moe)), expected, atol=1e-6, rtol=1e-5)
        handle.remove()
    assert len(seen) == 4
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    check(kernelize(moe))
    handle.remove()
    kernelize(moe)
    for impl in ("eager", "grouped_mm", "batched_mm"):
        cfg._experts_implementation = impl
        with torch.no_grad():
            torch.testing.assert_close(moe(x), expected, atol=1e-5, rtol=1e-5)
    cfg._experts_implementation = K3_GROUPED_MM
    for overrides in ({"moe_router_activation_func": "softmax"}, {"num_experts": 16, "num_expert_group": 4,
                                                                  "topk_group": 2}):
        other_cfg, other = kernel_moe(_experts_implementation=K3_GROUPED_MM, **overrides)
        torch.testing.assert_close(check(other), ref_moe(other, x, other_cfg).float(), atol=1e-5, rtol=1e-5)

    class Wrapped(torch.nn.Linear):  # (a LoRA or quantized layer is another class)
        pass

    big_cfg, big = kernel_moe(_experts_implementation=K3_GROUPED_MM, hidden_size=512, routed_expert_hidden_size=256,
                            num_experts=64, num_experts_per_tok=16, moe_intermediate_size=64)  # 1.18M MACs
    check(big, inputs(1, 1, 512))  # fp32: beyond the one-thread kernel's limit
    big.bfloat16().gate.e_score_correction_bias = big.gate.e_score_correction_bias.float()  # (as a bf16 load keeps it)
    big_x = inputs(1, 1, 512).bfloat16()
    with torch.no_grad():
        big_out = big(big_x)
    got = kernel_output(big, big_x)  # bf16: within its larger limit
    assert got is not None and torch.equal(big_out.reshape(got.shape), got)
    torch.testing.assert_close(big_out.float(), modules_path(big, big_x).float(), atol=2e-2, rtol=1e-2)
    lora = Wrapped(cfg.routed_expert_hidden_size, cfg.hidden_size, bias=False)
    lora.weight = moe.routed_expert_up_proj.weight
    moe.routed_expert_up_proj = lora
    torch.testing.assert_close(check(), expected, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        assert moe(inputs(1, 0, cfg.hidden_size)).shape == (1, 0, cfg.hidden_size)


def test_decode_step_drops_its_plan_when_pickled():
    """The kernel's description of this process's memory is neither pickled nor deep-copied: a copy plans anew
    on its own weights."""
    import copy
    import io

    decode_kernel_or_skip()
    cfg, moe = kernel_moe(_experts_implementation=K3_GROUPED_MM)
    x = inputs(1, 2, cfg.hidden_size)
    with torch.no_grad():
        out = moe(x)
        twin = copy.deepcopy(moe)
        buffer = io.BytesIO()
        torch.save(moe, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert torch.equal(twin(x), out) and torch.equal(loaded(x), out)
        twin.experts.down_proj.zero_()
        assert torch.equal(moe(x), out) and not torch.equal(twin(x), out)
    for layer in (moe, twin, loaded):
        with torch.no_grad():
            assert_kernel_computes(layer, x, layer(x), cfg)


def test_decode_step_follows_settings_changed_on_a_built_layer():
    """The router's and norm's settings set on a built layer (fewer experts per token, another scaling factor, no
    renormalization, another eps, a softmax or grouped router) reach the next decode step, which then computes
    what the modules compute, or steps aside where they no longer fit the kernel."""
    decode_kernel_or_skip()
    cfg, moe = kernel_moe(_experts_implementation=K3_GROUPED_MM, latent_moe_use_norm=False)  # (the norm hides the scale)
    x = inputs(1, 2, cfg.hidden_size)
    changes = [(moe.gate, "top_k", 1, True), (moe.gate, "routed_scaling_factor", 7.0, True),
               (moe.gate, "renormalize", False, True), (moe.gate, "use_softmax", True, False),
               (moe.gate, "num_expert_group", 2, False)]  # fmt: skip
    for module, name, value, kernel in changes:
        with torch.no_grad():
            moe(x)  # (a plan for the settings before)
        before = getattr(module, name)
        setattr(module, name, value)
        with torch.no_grad():
            out = moe(x)
        got = kernel_output(moe, x)
        assert (got is not None) == kernel, name
        expected = modules_path(moe, x)
        if got is not None:
            assert torch.equal(out.reshape(got.shape), got), name
        else:
            assert torch.equal(out, expected), name
        torch.testing.assert_close(out, expected, atol=1e-6 * expected.abs().max().item(), rtol=1e-5)
        setattr(module, name, before)
    cfg, moe = kernel_moe(_experts_implementation=K3_GROUPED_MM)
    with torch.no_grad():
        moe(x)
    moe.routed_expert_norm.variance_epsilon = 10.0
    with torch.no_grad():
        torch.testing.assert_close(moe(x), modules_path(moe, x), atol=1e-6, rtol=1e-5)


def test_decode_step_steps_aside_for_weights_that_are_not_parameters():
    """A weight parametrized after `kernelize` (torch.nn.utils.parametrize moves it out of the module's parameters:
    the kernel is detached) or held as a plain tensor attribute (FSDP's views of its flat parameter) runs the
    modules, with their result, instead of failing on the missing parameter."""
    import torch.nn.utils.parametrize as parametrize

    decode_kernel_or_skip()

    class Negated(torch.nn.Module):
        def forward(self, weight):
            return -weight

    x = inputs(1, 1, 64)
    for module_name, name in (("routed_expert_down_proj", "weight"), ("gate", "weight"),
                              ("experts", "gate_up_proj"), ("routed_expert_norm", "weight")):  # fmt: skip
        cfg, moe = kernel_moe(_experts_implementation=K3_GROUPED_MM)
        with torch.no_grad():
            moe(x)
        module = getattr(moe, module_name)
        parametrize.register_parametrization(module, name, Negated())
        with torch.no_grad():
            torch.testing.assert_close(moe(x), modules_path(moe, x), atol=0, rtol=0)
        assert kernel_output(moe, x) is None, module_name
        parametrize.remove_parametrizations(module, name)  # (the negated weight, a new parameter)
        kernelize(moe)  # (the module tree changed: attach again)
        with torch.no_grad():
            out = moe(x)
        torch.testing.assert_close(out, modules_path(moe, x), atol=1e-6, rtol=1e-5)
        assert_kernel_computes(moe, x, out, cfg)
    weight = moe.gate.weight.detach().clone()
    del moe.gate.weight
    moe.gate.weight = weight
    with torch.no_grad():
        torch.testing.assert_close(moe(x), modules_path(moe, x), atol=0, rtol=0)
    assert kernel_output(moe, x) is None


def test_decode_step_replans_when_a_weight_changes_shape_in_place():
    """Experts pruned in place (``param.data = param.data[:4]``: the same tensors and data pointers, fewer
    experts) reach the next decode step."""
    decode_kernel_or_skip()
    cfg, moe = kernel_moe(_experts_implementation=K3_GROUPED_MM)
    x = inputs(1, 1, cfg.hidden_size, seed=3)
    with torch.no_grad():
        moe(x)
        for tensor in (moe.gate.weight, moe.gate.e_score_correction_bias, moe.experts.gate_up_proj,
                       moe.experts.down_proj):  # fmt: skip
            tensor.data = tensor.data[:4]
        moe.gate.num_experts = moe.experts.num_experts = 4
        out = moe(x)
    torch.testing.assert_close(out, modules_path(moe, x), atol=1e-6, rtol=1e-5)
    cfg.num_experts = 4  # (the float64 reference's router reads it)
    assert_kernel_computes(moe, x, out, cfg)


def test_decode_step_steps_aside_under_autocast():
    """Under CPU autocast the modules' linear layers compute in bf16 (and return bf16): the modules run."""
    decode_kernel_or_skip()
    cfg, moe = kernel_moe(_experts_implementation=K3_GROUPED_MM)
    x = inputs(1, 2, cfg.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            out = moe(x)
        expected = modules_path(moe, x)
        assert kernel_output(moe, x) is None
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_bf16_decode_step_steps_aside_for_experts_the_experts_kernel_does_not_take():
    """bf16 experts larger than the experts kernel takes (3 D I > SMALL_EXPERT_FLOATS) run torch's bf16 products in
    the modules, rounded at each step: not the decode kernel's quantity, so the modules run (their bits)."""
    decode_kernel_or_skip()
    cfg, moe = kernel_moe(_experts_implementation=K3_GROUPED_MM, hidden_size=128, routed_expert_hidden_size=512,
                        moe_intermediate_size=256)  # 3 x 512 x 256 = 393,216 > 196,608; 1.02M MACs a token
    moe = moe.bfloat16()
    x = inputs(1, 2, cfg.hidden_size).bfloat16()
    with torch.no_grad():
        out = moe(x)
    assert kernel_output(moe, x) is None and torch.equal(out, modules_path(moe, x))


def test_decode_step_needs_the_sigmoid_the_modules_router_uses(monkeypatch):
    """The decode kernel selects from the kernels' sigmoid; where that is not bitwise torch.sigmoid (another torch
    build: the modules' router then selects from torch's scores) the modules run."""
    decode_kernel_or_skip()
    # why: simulates a torch build whose sigmoid is not the kernel's bit for bit
    monkeypatch.setattr(cpu_kernel, "_sigmoid_matches_torch", lambda lib: False)
    assert cpu_kernel.moe_decode_max_tokens() == 0


def test_kernel_layer_decorates_module_classes_only():
    """A `kernel_layer` line left above a function (not the class it was meant for) fails at import, instead of
    leaving the class without its kernel name and the layer without its kernel."""
    from transformers_k3.ops.kernel_layers import kernel_layer

    with pytest.raises(TypeError, match="nn.Module class"):
        kernel_layer("k3_experts")(lambda config: None)


def test_kernelized_model_records_router_logits_asked_for_in_the_config():
    """``config.output_router_logits`` (not only the call's keyword) reaches the MoE layers: a kernelized model's
    cached decode step returns every MoE layer's router logits, those of the plain model, and the same logits."""
    import copy

    from transformers_k3 import KimiK3ForCausalLM, KimiK3HybridCache, KimiK3TextConfig

    torch.manual_seed(0)
    plain = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()
    plain.config.output_router_logits = True
    fused = kernelize(copy.deepcopy(plain))
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(1))
    outs = []
    for model in (fused, plain):
        cache = KimiK3HybridCache(model.config)
        with torch.no_grad():
            model(ids[:, :8], past_key_values=cache, use_cache=True)
            outs.append(model(ids[:, 8:], past_key_values=cache, use_cache=True))
    got, want = outs
    moe_layers = sum(isinstance(m, KimiK3SparseMoE) for m in plain.modules())
    assert len(got.router_logits) == len(want.router_logits) == moe_layers > 0
    for a, b in zip(got.router_logits, want.router_logits):
        assert a.shape == (1, plain.config.num_experts)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
