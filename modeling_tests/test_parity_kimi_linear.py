"""Parity with a real peer: transformers' in-tree Kimi Linear.

With the K3-only features switched off by config (no AttnRes, experts at full width, SiLU-GLU, the softplus
KDA gate, the low-rank KDA output gate, no MLA output gate) a K3 model is Kimi Linear. Both models get the
same random weights (the in-tree model's, renamed to the official layout) and must give the same logits
(fp32, <= 1e-4; observed ~1e-6) and identical greedy generations.

The only structural difference between the two layouts: Kimi Linear fuses the three short convolutions
into one `conv1d` over q|k|v and keeps the forget-gate weights under `forget_gate.`; K3 (like the
official checkpoints) keeps `q_conv1d`/`k_conv1d`/`v_conv1d` and `f_a_proj`/`f_b_proj`/`A_log`/`dt_bias`
directly on the attention module.
"""

import pytest
import torch
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig
from transformers_k3.conversion import kimi_linear_to_k3_state_dict  # the in-tree -> K3 key map

HIDDEN, LAYERS, HEADS, VOCAB = 64, 6, 4, 512
KDA_HEADS, KDA_DIM = 4, 16


def kimi_linear_config(**overrides) -> KimiLinearConfig:
    values = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True,
        hidden_act="silu", rms_norm_eps=1e-5, num_local_experts=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False,
        linear_attn_config={"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6], "num_heads": KDA_HEADS,
                            "head_dim": KDA_DIM, "short_conv_kernel_size": 4},
        first_k_dense_replace=1,
    )
    values.update(overrides)
    return KimiLinearConfig(**values)


def k3_config_matching(kl: KimiLinearConfig) -> KimiK3TextConfig:
    return KimiK3TextConfig(
        vocab_size=kl.vocab_size, hidden_size=kl.hidden_size, intermediate_size=kl.intermediate_size,
        num_hidden_layers=kl.num_hidden_layers, num_attention_heads=kl.num_attention_heads,
        q_lora_rank=kl.q_lora_rank, kv_lora_rank=kl.kv_lora_rank, qk_nope_head_dim=kl.qk_nope_head_dim,
        qk_rope_head_dim=kl.qk_rope_head_dim, v_head_dim=kl.v_head_dim, mla_use_output_gate=False,
        hidden_act="silu", rms_norm_eps=kl.rms_norm_eps, num_experts=kl.num_local_experts,
        num_experts_per_token=kl.num_experts_per_tok, num_shared_experts=kl.n_shared_experts,
        moe_intermediate_size=kl.moe_intermediate_size, routed_expert_hidden_size=None,
        latent_moe_use_norm=False, first_k_dense_replace=1, routed_scaling_factor=kl.routed_scaling_factor,
        num_expert_group=kl.n_group, topk_group=kl.topk_group, attn_res_block_size=None,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        # Kimi Linear's norm eps choices (K3_SPEC.md section 12): q_a/kv_a norms 1e-6, KDA o_norm rms_norm_eps
        mla_latent_norm_eps=1e-6, kda_o_norm_eps=kl.rms_norm_eps,
        linear_attn_config={"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6], "num_heads": KDA_HEADS,
                            "head_dim": KDA_DIM, "short_conv_kernel_size": 4, "use_full_rank_gate": False,
                            "gate_lower_bound": None},
    )


def build_pair(seed: int = 0, attn_implementation: str = "eager"):
    torch.manual_seed(seed)
    kl_config = kimi_linear_config()
    kl_config._attn_implementation = attn_implementation
    reference = KimiLinearForCausalLM(kl_config).eval()
    with torch.no_grad():  # the in-tree init leaves some weights at exactly 0/1; randomise everything
        for name, param in reference.named_parameters():
            if "A_log" in name or "dt_bias" in name:
                continue
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif param.dim() > 1:
                param.normal_(0, 0.08)
        for layer in reference.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    k3_config = k3_config_matching(kl_config)
    k3_config._attn_implementation = attn_implementation
    model = KimiK3ForCausalLM(k3_config).eval()
    state = kimi_linear_to_k3_state_dict(reference.state_dict(), KDA_HEADS)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return reference, model


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
