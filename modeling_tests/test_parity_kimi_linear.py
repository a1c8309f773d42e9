"""Parity with a real peer: transformers' in-tree Kimi Linear.

With the K3-only features switched off by config (no AttnRes, experts at full width, SiLU-GLU, the softplus
KDA gate, the low-rank KDA output gate, no MLA output gate) a K3 model is Kimi Linear. Both models get the
same random weights (the in-tree model's, renamed to ours) and must give the same logits
(fp32, <= 1e-4; observed ~1e-6) and identical greedy generations.

The only structural difference between the two models: Kimi Linear keeps the forget-gate weights under
`forget_gate.`; K3 (like the official checkpoints) keeps `f_a_proj`/`f_b_proj`/`A_log`/`dt_bias` directly on the
attention module. Both stack the three short-convolution filters into one `conv1d` over q|k|v.
"""

import copy
import functools

import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

from references import KDA_HEADS, VOCAB, KimiLinearForCausalLM, build_pair, k3_config_matching, kimi_linear_config
from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig
from transformers_k3.conversion import kimi_linear_to_k3_state_dict
from transformers_k3.modeling_kimi_k3 import KimiK3Router


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_logits_match_in_tree_kimi_linear(attn_implementation):
    reference, model = build_pair(attn_implementation=attn_implementation)
    ids = torch.randint(3, VOCAB, (2, 70))  # crosses a 64-token KDA chunk boundary
    with torch.no_grad():
        want = reference(ids).logits
        got = model(ids).logits
    diff = (want - got).abs().max().item()
    assert diff <= 1e-4, diff


def test_greedy_generation_matches_in_tree_kimi_linear():
    reference, model = build_pair(seed=1)
    ids = torch.randint(3, VOCAB, (1, 9))
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        got = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(want, got)


def test_k3_features_change_the_function():
    """The parity above must not hold by accident: switching any K3 feature back on changes the logits."""
    reference, model = build_pair()
    ids = torch.randint(3, VOCAB, (1, 16))
    with torch.no_grad():
        base = model(ids).logits
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "lower_bound"):
                layer.self_attn.lower_bound = -5.0  # the K3 safe gate instead of softplus
        changed = model(ids).logits
    assert (base - changed).abs().max() > 1e-3


def _bf16_gradient_error(model, ids):
    """Relative L2 error of all of ``model``'s parameter gradients (one LM loss on ``ids``) in bf16 against the same
    weights in float64, with the bf16 run's top-k expert selection pinned to the float64 run's: at init scale a few
    router scores are near-tied, and which of them bf16 flips is a per-seed lottery (docs/correctness.md, "bf16
    gradients"). The bf16 run still computes the chosen experts' weights from its own logits."""
    flat, chosen = [], []
    for dtype in (torch.float64, torch.bfloat16):
        copy_ = copy.deepcopy(model).to(dtype).train()
        copy_.set_experts_implementation("eager")  # (grouped_mm has no float64 kernel on CPU)
        routers = [m for m in copy_.modules() if isinstance(m, (KimiK3Router, KimiLinearTopkRouter))]
        handles = [router.register_forward_hook(functools.partial(_pin_selection, chosen, i, dtype == torch.bfloat16))
                   for i, router in enumerate(routers)]
        copy_(input_ids=ids, labels=ids).loss.backward()
        for handle in handles:
            handle.remove()
        flat.append(torch.cat([p.grad.double().flatten() for p in copy_.parameters() if p.grad is not None]))
    got, want = flat[1], flat[0]
    return ((got - want).norm() / want.norm()).item()


def _pin_selection(chosen, index, pin, router, args, output):
    """Router forward hook: records the selection (float64 run) or replaces it with the recorded one (bf16 run), the
    weights of the chosen experts recomputed as both routers compute them (sigmoid, renormalised, scaled)."""
    logits, _, indices = output
    if not pin:
        chosen.append(indices)
        return None
    indices = chosen[index]
    hidden = args[0].reshape(-1, router.weight.shape[1])
    selected = torch.sigmoid(hidden.float() @ router.weight.float().T).gather(1, indices)
    return logits, selected / (selected.sum(-1, keepdim=True) + 1e-20) * router.routed_scaling_factor, indices


def test_bf16_gradients_at_init_scale_are_as_close_to_float64_as_kimi_linears(one_thread):
    """bf16 training gradients: K3 is no further from float64 than in-tree Kimi Linear on the same weights (the
    initialisation, std 0.02), and the tiny K3 with every feature on is as close. At the larger random weights of
    `randomize_` both models are chaotic (top-k flips, and K3's latent-MoE norm with a gain of 1/rms): there bf16
    weight rounding alone moves the gradients far in float64 math, see docs/correctness.md ("bf16 gradients")."""
    torch.manual_seed(0)
    kl_config = kimi_linear_config()
    reference = KimiLinearForCausalLM(kl_config)
    model = KimiK3ForCausalLM(k3_config_matching(kl_config))
    missing, unexpected = model.load_state_dict(kimi_linear_to_k3_state_dict(reference.state_dict(), KDA_HEADS),
                                                strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    torch.manual_seed(0)
    full = KimiK3ForCausalLM(KimiK3TextConfig.tiny())
    ids = torch.randint(3, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    want = _bf16_gradient_error(reference, ids)
    errors = {"k3 as kimi linear": _bf16_gradient_error(model, ids), "k3 tiny": _bf16_gradient_error(full, ids)}
    assert want <= 0.03, want  # the peer itself: bf16's 2**-9 rounding, grown a few times through the layers
    assert all(err <= 1.25 * want for err in errors.values()), (want, errors)
