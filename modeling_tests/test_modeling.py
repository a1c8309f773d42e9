"""The K3 text model end to end: Auto classes, save/load, caching and generation, padding, outputs, training."""

import copy
import json

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

from transformers_k3 import (
    KimiK3Config,
    KimiK3ConfigError,
    KimiK3ForCausalLM,
    KimiK3HybridCache,
    KimiK3Model,
    KimiK3TextConfig,
)

from references import randomize_, train_losses


def assert_close_logits(got, want, rel=1e-5):
    """Model-level fp32 comparison relative to the logit scale. The paths compared run different GEMM shapes
    (one row per decode step vs the whole prompt), and K3 computes norms, gates, router and AttnRes in fp32 by
    spec, so each op contributes ~1e-7 relative rounding that compounds over the stack: ~6e-6 observed."""
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= rel, err


def greedy(model, ids, n, **kwargs):
    return model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)


# ---------------------------------------------------------------- Auto classes and persistence
def test_auto_from_config_save_and_reload(tmp_path, tiny_model):
    assert isinstance(AutoModelForCausalLM.from_config(tiny_model.config), KimiK3ForCausalLM)
    assert isinstance(AutoModel.from_config(tiny_model.config), KimiK3Model)
    tiny_model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "kimi_k3_text"  # our registered type (the release's config is the exporter's)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), KimiK3TextConfig)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no trust_remote_code
    assert isinstance(reloaded, KimiK3ForCausalLM)
    ids = torch.randint(3, 512, (2, 11))
    with torch.no_grad():
        assert torch.equal(tiny_model(ids).logits, reloaded(ids).logits)
    assert torch.equal(greedy(tiny_model, ids, 6), greedy(reloaded, ids, 6))


def test_composite_config_loads_for_text_only_use(tmp_path, tiny_model):
    composite = KimiK3Config(text_config=tiny_model.config.to_dict(), vision_config=None)
    composite.save_pretrained(tmp_path)
    tiny_model.save_pretrained(tmp_path / "weights")
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "weights" / "model.safetensors").read_bytes())
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, KimiK3Config) and isinstance(config.text_config, KimiK3TextConfig)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(model, KimiK3ForCausalLM)
    ids = torch.randint(3, 512, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny_model(ids).logits)


def test_official_text_config_with_kimi_linear_model_type():
    """The official text_config says model_type "kimi_linear" and uses 1-based layer lists."""
    text = KimiK3TextConfig.tiny().to_dict()
    for key in ("layer_types", "mlp_layer_types", "transformers_version"):
        text.pop(key)
    text["model_type"] = "kimi_linear"
    composite = KimiK3Config(text_config=text, vision_config={"model_type": "kimi_k3_vision"})
    assert isinstance(composite.text_config, KimiK3TextConfig)
    assert composite.text_config.layer_types == ["linear_attention", "linear_attention", "full_attention"] * 2
    assert composite.vision_config.text_hidden_size == 64


def test_flat_k3_kimi_linear_config_is_routed_to_k3(tmp_path):
    text = KimiK3TextConfig.tiny().to_dict()
    text["model_type"] = "kimi_linear"
    (tmp_path / "config.json").write_text(json.dumps(text))
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, KimiK3TextConfig)
    assert isinstance(AutoModelForCausalLM.from_config(config), KimiK3ForCausalLM)
    # a genuine Kimi Linear config still goes to the in-tree model
    plain = KimiLinearConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64,
                             num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                             intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                             v_head_dim=8, pad_token_id=0, linear_attn_config={"num_heads": 2, "head_dim": 8})
    plain.save_pretrained(tmp_path / "plain")
    assert isinstance(AutoConfig.from_pretrained(tmp_path / "plain"), KimiLinearConfig)
    assert isinstance(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "plain")),
                      KimiLinearForCausalLM)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_experts_per_token=9), "num_experts_per_token"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [3]}), "linear_attn_config"),
        (dict(linear_attn_config={"kda_layers": [0, 1, 2, 4, 5], "full_attn_layers": [3, 6]}), "linear_attn_config"),
        (dict(linear_attn_config={"gate_lower_bound": 2.0}), "linear_attn_config.gate_lower_bound"),
        (dict(linear_attn_config={"head_dim": 0}), "linear_attn_config.head_dim"),
        (dict(num_expert_group=3), "num_expert_group"),
        (dict(attn_res_block_size=0), "attn_res_block_size"),
        (dict(hidden_size=-4), "hidden_size"),
        (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling"),
        (dict(routed_scaling_factor=0), "routed_scaling_factor"),
        (dict(pad_token_id=10**6), "pad_token_id"),
        (dict(eos_token_id=[2, 10**6]), "eos_token_id"),
        (dict(attention_dropout=2.0), "attention_dropout"),
        (dict(max_position_embeddings=0), "max_position_embeddings"),
        (dict(mlp_layer_types=["dense", "foo", "sparse", "sparse", "sparse", "sparse"]), "mlp_layer_types"),
        (dict(first_k_dense_replace=-1), "first_k_dense_replace"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(KimiK3ConfigError, match=f"`{field}`"):
        KimiK3TextConfig.tiny(**overrides)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, {"type": "default", "rope_theta": 10000.0}])
def test_rope_scaling_that_scales_nothing_is_accepted(tmp_path, scaling):
    """A config.json may spell "no RoPE scaling" as the default type (SGLang reads it as a no-op): it loads (the
    model reads no RoPE setting at all; any other type is refused, test_bad_config_names_the_field)."""
    config = KimiK3TextConfig.tiny(rope_scaling=scaling)
    config.save_pretrained(tmp_path)
    assert KimiK3TextConfig.from_pretrained(tmp_path).rope_scaling == scaling


def test_full_size_defaults_match_the_release():
    config = KimiK3TextConfig()
    assert (config.hidden_size, config.num_hidden_layers, config.num_experts, config.num_experts_per_tok) == (
        7168, 93, 896, 16)
    assert config.linear_num_heads * config.linear_head_dim == 12288
    assert config.kv_lora_rank + config.qk_rope_head_dim == 576


# ---------------------------------------------------------------- caching and generation
def test_greedy_with_cache_equals_without(tiny_model):
    ids = torch.randint(3, 512, (2, 13))
    assert torch.equal(greedy(tiny_model, ids, 12), greedy(tiny_model, ids, 12, use_cache=False))


@pytest.mark.parametrize("prefill", [1, 5, 60, 64])
def test_incremental_decode_equals_full_forward(tiny_model, prefill):
    """Invariant 11.1.6: prefill then token-by-token decode (across the 64-token chunk boundary) gives the
    logits of one full forward."""
    ids = torch.randint(3, 512, (2, 70))
    with torch.no_grad():
        full = tiny_model(ids).logits
        cache = KimiK3HybridCache(tiny_model.config)
        steps = [tiny_model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
        for t in range(prefill, ids.shape[1]):
            steps.append(tiny_model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    assert_close_logits(torch.cat(steps, dim=1), full)


def test_multi_token_continuation_equals_full_forward(tiny_model):
    """Cached continuations of 3, RECURRENT_MAX_LEN (16: token loop and step convolutions), 17 (chunked
    form from a state) and 41 tokens."""
    ids = torch.randint(3, 512, (1, 107))
    with torch.no_grad():
        full = tiny_model(ids).logits
        cache = KimiK3HybridCache(tiny_model.config)
        parts = [tiny_model(ids[:, a:b], past_key_values=cache, use_cache=True).logits
                 for a, b in ((0, 30), (30, 33), (33, 49), (49, 66), (66, 107))]
    assert_close_logits(torch.cat(parts, dim=1), full)


def test_left_padded_batch_equals_unpadded_rows(tiny_model):
    rows = [torch.randint(3, 512, (n,)) for n in (9, 4, 13)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    batched = greedy(tiny_model, ids, 10, attention_mask=mask)
    with torch.no_grad():
        padded_logits = tiny_model(ids, attention_mask=mask).logits
    for i, r in enumerate(rows):
        alone = greedy(tiny_model, r[None], 10)
        assert torch.equal(batched[i, width:], alone[0, len(r):]), i
        with torch.no_grad():
            alone_logits = tiny_model(r[None]).logits[0]
        assert_close_logits(padded_logits[i, width - len(r):], alone_logits)


def test_beam_search_and_multiple_return_sequences(tiny_model):
    ids = torch.randint(3, 512, (2, 6))
    out = tiny_model.generate(ids, max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    assert out.shape == (4, 11)
    sampled = tiny_model.generate(ids, max_new_tokens=5, do_sample=True, num_return_sequences=3,
                                  eos_token_id=None, pad_token_id=0)
    assert sampled.shape == (6, 11)
    # beam search with one beam is greedy
    one_beam = tiny_model.generate(ids, max_new_tokens=5, num_beams=1, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
    assert torch.equal(one_beam, greedy(tiny_model, ids, 5))


def test_continue_generation_from_returned_cache(tiny_model):
    ids = torch.randint(3, 512, (1, 8))
    out = tiny_model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0,
                              return_dict_in_generate=True)
    assert isinstance(out.past_key_values, KimiK3HybridCache)
    more = tiny_model.generate(out.sequences, past_key_values=out.past_key_values, max_new_tokens=4,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(more, greedy(tiny_model, ids, 8))


def test_mla_cache_holds_only_the_latent(tiny_model):
    config = tiny_model.config
    ids = torch.randint(3, 512, (2, 37))
    cache = KimiK3HybridCache(config)
    with torch.no_grad():
        tiny_model(ids, past_key_values=cache, use_cache=True)
    per_token = config.kv_lora_rank + config.qk_rope_head_dim
    for idx, kind in enumerate(config.layer_types):
        layer = cache.layers[idx]
        if kind == "full_attention":
            assert layer.latent.shape[-1] == per_token and layer.get_seq_length() == 37
        else:
            P = config.linear_num_heads * config.linear_head_dim
            assert layer.conv_state.shape == (2, 3 * P, config.linear_conv_kernel_size - 1)
            assert layer.recurrent_state.shape == (2, config.linear_num_heads, config.linear_head_dim,
                                                   config.linear_head_dim)
            assert layer.recurrent_state.dtype == torch.float32
    assert cache.get_seq_length() == 37


def test_absorbed_decode_matches_expanded_attention(tiny_model):
    """Latent-space attention (decode) == expanded K/V attention (prefill path), with an explicit causal mask and
    with the absorbed path's own causal masking (mask None), for a 5-token step after 15 cached tokens."""
    mla = next(layer.self_attn for layer in tiny_model.model.layers if layer.layer_type == "full_attention")
    x = torch.randn(2, 20, tiny_model.config.hidden_size)
    causal = torch.ones(5, 20, dtype=torch.bool).tril(15)[None, None]
    results = []
    with torch.no_grad():
        for absorb, mask in ((False, causal), (True, causal), (True, None)):
            cache = KimiK3HybridCache(tiny_model.config)
            mla(x[:, :15], past_key_values=cache)
            results.append(mla(x[:, 15:], attention_mask=mask, past_key_values=cache, absorb=absorb)[0])
    assert (results[0] - results[1]).abs().max() <= 1e-5
    assert (results[0] - results[2]).abs().max() <= 1e-5


@pytest.mark.parametrize("kernels", [True, False])
def test_absorbed_decode_logits_are_fp32_sums_of_the_bf16_products(kernels):
    """The absorbed decode's logits from a bf16 latent and queries are the fp32 sums of their (exact) products:
    within fp32 rounding of float64's, where a bf16 matmul rounds each to 8 bits. With the kernels (the bf16 ->
    fp32 GEMM) and without (fp32 copies, a few context blocks at a time)."""
    from transformers_k3.ops.linear import products_f32

    gen = torch.Generator().manual_seed(0)
    for batch, seq, m in ((1, 3, 4), (2, 40, 6), (2, 1, 1)):
        latent = torch.randn(batch, seq, 96, generator=gen).bfloat16()
        q_cat = (3 * torch.randn(batch, m, 96, generator=gen)).bfloat16()
        got = products_f32(latent, q_cat, 7, kernels)  # (the absorbed decode's logits; 7 latent rows a block)
        want = q_cat.double() @ latent.double().transpose(1, 2)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got.double() - want).abs().max() <= 2e-5 * want.abs().max()
        if seq * m > 100:  # (the test tells the two apart: a bf16 matmul's logits are ~100x further off)
            rounded = (q_cat @ latent.transpose(1, 2)).double()
            assert (rounded - want).abs().max() > 1e-3 * want.abs().max()


def test_bf16_absorbed_decode_keeps_logits_in_fp32(tiny_model):
    """A bf16 decode step's attention in latent space against the same attention in float64 on the same bf16 inputs,
    at logits spread as in a trained model (several units): with fp32 logits, in one pass of the kernels or in two
    without them, ~3x closer (0.33 % vs 1.0 % relative) than with a bf16 matmul's logits (every logit rounded to 8
    bits before the softmax)."""
    import torch.nn.functional as F

    from transformers_k3 import kernelize

    def bf16_logits(latent, queries, scale, value_dim, new_tokens, block, mask=None):
        probs = F.softmax(torch.matmul(queries, latent.transpose(1, 2)) * scale, dim=-1, dtype=torch.float32)
        return torch.matmul(probs.to(queries.dtype), latent)[..., :value_dim]

    mla = next(layer.self_attn for layer in tiny_model.model.layers if layer.layer_type == "full_attention")
    gen = torch.Generator().manual_seed(1)
    latent = torch.randn(2, 300, mla.kv_lora_rank + mla.qk_rope_head_dim, generator=gen).bfloat16()
    query = (8 * torch.randn(2, mla.num_heads, 1, mla.qk_head_dim, generator=gen)).bfloat16()
    errors = {}
    with torch.no_grad():
        reference = mla.double()._absorbed_attention(query.double(), latent.double(), None)
        layer = mla.to(torch.bfloat16)
        for name in ("fp32 logits, kernels", "fp32 logits, no kernels", "bf16 logits"):
            kernelize(layer, name == "fp32 logits, kernels")
            if name == "bf16 logits":  # (the baseline being measured, in the layer's kernel slot)
                layer.kernel = bf16_logits
            got = layer._absorbed_attention(query, latent, None).double()
            errors[name] = ((got - reference).norm() / reference.norm()).item()
        mla.float()
    print(errors)
    assert errors["fp32 logits, kernels"] * 2 < errors["bf16 logits"], errors
    assert errors["fp32 logits, no kernels"] * 2 < errors["bf16 logits"], errors


def test_blockwise_context_attention_matches_masked_attention(tiny_model):
    """A chunk after cached tokens attends to the context block by block, merging by log-sum-exp (no [T, context]
    mask): equal to expanded attention under the explicit causal mask, for blocks that split the context unevenly."""
    mla = next(layer.self_attn for layer in tiny_model.model.layers if layer.layer_type == "full_attention")
    x = torch.randn(2, 60, tiny_model.config.hidden_size)
    causal = torch.ones(25, 60, dtype=torch.bool).tril(35)[None, None]
    results, default = [], mla.context_block
    with torch.no_grad():
        # blocks that split a 35-token context unevenly, without a 16K-token context
        for block, mask in ((default, causal), (7, None), (35, None), (1000, None)):
            mla.context_block = block
            cache = KimiK3HybridCache(tiny_model.config)
            mla(x[:, :35], past_key_values=cache)
            results.append(mla(x[:, 35:], attention_mask=mask, past_key_values=cache, absorb=False)[0])
    for got in results[1:]:
        assert (got - results[0]).abs().max() <= 1e-5


def _operand_shapes(run) -> set[tuple[int, ...]]:
    """The shapes of every operand of every operator ``run()`` calls (torch's profiler, recording shapes)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    return {tuple(shape) for event in prof.events() for shape in event.input_shapes if shape}


def test_chunked_prefill_builds_no_context_mask(tiny_model):
    """An unpadded chunk after cached tokens builds no [T, context] tensor (a mask or whole score rows would be
    [T, context]: 4 GiB at a million tokens; MLA attends block by block) and still equals one forward; a padded batch
    (which keeps its mask) chunked equals its one forward too."""
    from transformers_k3.modeling_kimi_k3 import KimiK3MLA

    layers = [layer for layer in tiny_model.modules() if isinstance(layer, KimiK3MLA)]
    for layer in layers:
        layer.context_block = 16  # several context blocks without a 16K-token context
    ids = torch.randint(3, 512, (2, 100))
    with torch.no_grad():
        full = tiny_model(ids).logits
        cache = KimiK3HybridCache(tiny_model.config)
        first = tiny_model(ids[:, :40], past_key_values=cache, use_cache=True).logits
        parts = []
        shapes = _operand_shapes(lambda: parts.append(tiny_model(ids[:, 40:], past_key_values=cache,
                                                                 use_cache=True).logits))  # fmt: skip
    assert_close_logits(torch.cat([first, *parts], dim=1), full)
    assert not [shape for shape in shapes if shape[-2:] == (60, 100)], "a [T, context] tensor was built"
    with torch.no_grad():
        mask = torch.ones(2, 100, dtype=torch.long)
        mask[0, :3] = 0
        want = tiny_model(ids, attention_mask=mask).logits
        cache = KimiK3HybridCache(tiny_model.config)
        got = [tiny_model(ids[:, :40], attention_mask=mask[:, :40], past_key_values=cache, use_cache=True).logits]
        shapes = _operand_shapes(lambda: got.append(tiny_model(ids[:, 40:], attention_mask=mask, past_key_values=cache,
                                                               use_cache=True).logits))  # fmt: skip
    assert [shape for shape in shapes if shape[-2:] == (60, 100)]  # (the padded batch's mask: what the walk sees)
    got = torch.cat(got, dim=1)
    assert_close_logits(got[0, 3:], want[0, 3:])
    assert_close_logits(got[1], want[1])


def test_logits_do_not_depend_on_position_ids(tiny_model):
    ids = torch.randint(3, 512, (1, 10))
    with torch.no_grad():
        a = tiny_model(ids).logits
        b = tiny_model(ids, position_ids=torch.arange(100, 110)[None]).logits
    assert torch.equal(a, b)


# ---------------------------------------------------------------- outputs and training
def test_recorded_outputs(tiny_model):
    config = tiny_model.config
    tiny_model.set_attn_implementation("eager")  # SDPA cannot return attention probabilities
    ids = torch.randint(3, 512, (2, 7))
    out = tiny_model(ids, output_hidden_states=True, output_router_logits=True, output_attentions=True,
                     output_attn_res_weights=True)
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    assert len(out.router_logits) == config.mlp_layer_types.count("sparse")
    assert out.router_logits[0].shape == (14, config.num_experts)
    assert len(out.attentions) == config.layer_types.count("full_attention")
    assert out.attentions[0].shape == (2, config.num_attention_heads, 7, 7)
    assert len(out.attn_res_weights) == 2 * config.num_hidden_layers + 1


def test_loss_backward_and_gradient_checkpointing(tiny_model):
    ids = torch.randint(3, 512, (2, 20))
    tiny_model.train()
    out = tiny_model(ids, labels=ids)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in tiny_model.named_parameters() if p.grad is not None}
    assert "model.layers.3.self_attention_res.pseudo_query" in grads
    assert grads["model.layers.0.self_attn.A_log"].abs().sum() > 0
    tiny_model.zero_grad()
    tiny_model.activation_checkpointing_enable()
    out2 = tiny_model(ids, labels=ids)
    out2.loss.backward()
    assert torch.allclose(out.loss, out2.loss, atol=1e-6)
    for name, param in tiny_model.named_parameters():
        if name in grads:
            assert torch.allclose(param.grad, grads[name], atol=1e-5, rtol=1e-4), name


def test_a_few_training_steps_reduce_the_loss(tiny_model):
    tiny_model.train()
    ids = torch.randint(3, 512, (4, 24))
    losses = train_losses(tiny_model, ids, torch.optim.AdamW(tiny_model.parameters(), lr=3e-3), steps=8)
    assert losses[-1] < 0.7 * losses[0], losses


def test_bf16_forward_and_generate(tiny_model):
    model = tiny_model.to(torch.bfloat16)
    ids = torch.randint(3, 512, (1, 12))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert greedy(model, ids, 4).shape == (1, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernelized_model_computes_the_plain_models_values(tiny_model, dtype):
    """`kernelize` (every fused CPU kernel attached: the MoE decode step, router, SiTU, RMSNorm, bf16 few-row
    linear) gives the plain model's logits on a cached prefill and the decode step after it, with
    ``output_router_logits`` recorded alike (fp32: 1e-4 of the largest; bf16: bf16 accuracy, as torch's bf16 matmul
    and the kernels' fp32 sums round apart). LoRA put on after `kernelize` (the shared experts' projections and,
    through `target_parameters`, the fused expert weights) changes the kernelized model's logits as it changes the
    plain model's."""
    import copy

    from transformers_k3 import KimiK3HybridCache, kernelize
    from transformers_k3.ops.experts import K3_CPU_KERNEL

    tol = 1e-4 if dtype is torch.float32 else 0.05
    plain = copy.deepcopy(tiny_model).to(dtype).eval()
    if dtype is torch.bfloat16:
        # bf16 experts in PyTorch round every product, which flips a near-tie routing downstream; the experts kernel
        # (one rounding) is the backend both sides take here, and test_cpu_kernels checks it against float64
        plain.set_experts_implementation(K3_CPU_KERNEL)
    fused = kernelize(copy.deepcopy(plain))
    assert any(m.kernel is not None for m in fused.modules() if type(m).__name__ == "KimiK3SparseMoE")
    ids = torch.randint(3, 512, (2, 31), generator=torch.Generator().manual_seed(0))

    def run(model, **kwargs):
        cache = KimiK3HybridCache(model.config)
        with torch.no_grad():
            prefill = model(ids[:, :30], past_key_values=cache, use_cache=True, **kwargs)
            step = model(ids[:, 30:], past_key_values=cache, use_cache=True, **kwargs)
        return prefill, step

    def close(got, want):
        torch.testing.assert_close(got.float(), want.float(), atol=tol * want.float().abs().max().item(), rtol=0)

    for recorded in (False, True):
        got, want = run(fused, output_router_logits=recorded), run(plain, output_router_logits=recorded)
        for a, b in zip(got, want):
            close(a.logits, b.logits)
            if recorded:
                assert len(a.router_logits) == len(b.router_logits) > 0
                for x, y in zip(a.router_logits, b.router_logits):
                    close(x, y)
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj"], init_lora_weights=False,
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    before = run(fused)[1].logits
    torch.manual_seed(1)
    adapted_plain = peft.get_peft_model(plain, copy.deepcopy(config)).eval()
    torch.manual_seed(1)
    adapted_fused = peft.get_peft_model(fused, copy.deepcopy(config)).eval()
    after = run(adapted_fused)[1].logits
    assert not torch.allclose(after.float(), before.float(), atol=tol * before.float().abs().max().item())
    close(after, run(adapted_plain)[1].logits)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_experts_implementations_agree_in_the_model(tiny_model, impl):
    ids = torch.randint(3, 512, (2, 9))
    with torch.no_grad():
        want = tiny_model(ids).logits
        tiny_model.set_experts_implementation(impl)
        got = tiny_model(ids).logits
    assert_close_logits(got, want)


def test_parallel_plans_name_real_modules(tiny_model):
    import fnmatch

    names = [n for n, _ in tiny_model.model.named_modules()] + [n for n, _ in tiny_model.model.named_parameters()]
    config = tiny_model.config
    for plan in (config.base_model_tp_plan, config.base_model_ep_plan):
        for pattern in plan:
            assert any(fnmatch.fnmatch(n, pattern) for n in names), pattern
    for name in config.base_model_pp_plan:
        assert hasattr(tiny_model.model, name), name


def test_kda_with_zero_beta_outputs_zero(tiny_model):
    """Invariant 11.1.7: beta = 0 keeps the state at 0, so the KDA layer outputs exactly 0."""
    layer = tiny_model.model.layers[0].self_attn
    # beta = sigmoid(b_proj(x)) underflows to exactly 0 for a pre-activation of -1e4, which no weights give for every
    # input: a forward hook replaces b_proj's output
    handle = layer.b_proj.register_forward_hook(lambda module, args, out: torch.full_like(out, -1e4))
    try:
        with torch.no_grad():
            out = layer(torch.randn(1, 10, tiny_model.config.hidden_size))
    finally:
        handle.remove()
    assert out.abs().max() == 0


# ---------------------------------------------------------------- rollback: assisted and prompt-lookup decoding
def test_crop_rolls_back_kda_and_mla_state(tiny_model):
    ids = torch.randint(3, 512, (2, 30))
    with torch.no_grad():
        want = tiny_model(ids[:, :25]).logits
        cache = KimiK3HybridCache(tiny_model.config)
        tiny_model(ids[:, :20], past_key_values=cache, use_cache=True)
        cache.activate_past_recording()
        tiny_model(ids[:, 20:30], past_key_values=cache, use_cache=True)  # 10 tokens, 5 of them to undo
        cache.crop(-5)
        assert cache.get_seq_length() == 25
        step = tiny_model(ids[:, 25:26], past_key_values=cache, use_cache=True).logits
        full = tiny_model(ids[:, :26]).logits
    assert_close_logits(step[:, -1], full[:, -1])
    assert want.shape[1] == 25


def test_crop_without_recording_is_refused(tiny_model):
    cache = KimiK3HybridCache(tiny_model.config)
    with torch.no_grad():
        tiny_model(torch.randint(3, 512, (1, 6)), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-2)


def _count_rollbacks(model):
    """The tokens taken back from ``model``'s cache between its calls (its length after a call against its length
    after the call before plus the tokens fed, on the same cache), read through a forward hook: a test proves
    rollback only if a candidate was rejected, which the tokens alone do not show."""
    undone, last = [], {}

    def after(module, args, kwargs, output):
        cache, fed = output.past_key_values, kwargs.get("input_ids", args[0] if args else None)
        fed = (fed if fed is not None else kwargs["inputs_embeds"]).shape[1]
        if last.get("cache") is cache:
            undone.append(last["length"] + fed - cache.get_seq_length())
        last.update(cache=cache, length=cache.get_seq_length())

    model.register_forward_hook(after, with_kwargs=True)
    return undone


def test_prompt_lookup_decoding_equals_greedy(tiny_model):
    # a repetitive prompt so that n-gram lookup proposes (and often gets wrong) candidates
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    want = greedy(tiny_model, ids, 24)
    undone = _count_rollbacks(tiny_model)
    got = greedy(tiny_model, ids, 24, prompt_lookup_num_tokens=4)
    assert torch.equal(want, got)
    assert any(n > 0 for n in undone), "no candidate was ever rejected: the rollback path was not exercised"


def test_assisted_decoding_equals_greedy(tiny_model):
    assistant = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny(num_hidden_layers=3, linear_attn_config={
        "kda_layers": [1, 2], "full_attn_layers": [3]})).eval(), seed=7)
    ids = torch.randint(3, 512, (1, 10))
    want = greedy(tiny_model, ids, 20)
    undone = _count_rollbacks(tiny_model)
    got = greedy(tiny_model, ids, 20, assistant_model=assistant)
    assert torch.equal(want, got)
    assert any(n > 0 for n in undone)
    # an assistant that agrees with the target exercises long accepted runs and the bonus token
    got_self = greedy(tiny_model, ids, 20, assistant_model=tiny_model)
    assert torch.equal(want, got_self)


@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant"])
def test_continuing_a_conversation_with_speculative_decoding_equals_greedy(tiny_model, mode):
    """A second turn from the first turn's returned cache with prompt-lookup or assisted decoding: their first step
    fed the whole history on top of the cache (transformers leaves it unsliced), which a recurrent state absorbs twice
    (wrong tokens from the first step); now it feeds only the tokens the cache lacks."""
    base = torch.tensor([[5, 6, 7, 8, 9, 10]])
    first = tiny_model.generate(torch.cat([base, base, base[:, :3]], 1), max_new_tokens=10, do_sample=False,
                                eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
    history = torch.cat([first.sequences, base], 1)
    want = greedy(tiny_model, history, 10, use_cache=False)
    extra = dict(prompt_lookup_num_tokens=4) if mode == "prompt_lookup" else dict(assistant_model=tiny_model)
    assert torch.equal(greedy(tiny_model, history, 10, past_key_values=first.past_key_values, **extra), want)
    # only the new tokens with the cache: a clear error (it failed deep in the convolution with a size mismatch)
    with pytest.raises(ValueError, match="pass the whole sequence"):
        greedy(tiny_model, base, 2, past_key_values=first.past_key_values)


# ---------------------------------------------------------------- chunked prefill, offload, persistence
def test_chunked_prefill_in_generate_equals_one_shot(tiny_model):
    ids = torch.randint(3, 512, (2, 90))
    want = greedy(tiny_model, ids, 8)
    for chunk in (16, 64, 37):
        assert torch.equal(greedy(tiny_model, ids, 8, prefill_chunk_size=chunk), want), chunk


def test_beam_search_keeps_a_reserved_cache_and_cache_implementations_map(tiny_model):
    """Beam search reorders a reserved (preallocated) latent buffer in place: its capacity never drops to the
    current length (which made every later step regrow and copy it); generate's cache_implementation names map onto
    the hybrid cache ("offloaded": latents kept on the CPU between steps) or are refused by name."""
    ids = torch.randint(3, 512, (1, 12))
    want = greedy(tiny_model, ids, 8, num_beams=3, use_cache=False)
    cache = KimiK3HybridCache(tiny_model.config, max_cache_len=100, batch_size=3)
    assert torch.equal(greedy(tiny_model, ids, 8, num_beams=3, past_key_values=cache), want)
    assert all(layer.latent.shape[1] == 100 for layer in cache.layers if hasattr(layer, "latent"))
    plain = greedy(tiny_model, ids, 6)
    for implementation in ("dynamic", "static", "offloaded", "offloaded_static"):
        assert torch.equal(greedy(tiny_model, ids, 6, cache_implementation=implementation), plain), implementation
    with pytest.raises(ValueError, match="cache_implementation='sliding_window' is not available for K3"):
        greedy(tiny_model, ids, 2, cache_implementation="sliding_window")


def test_left_padded_prompt_prefilled_token_by_token_equals_the_prompt_alone(tiny_model):
    """Left padding leaves the KDA state untouched also when a padded prompt is pre-filled one token at a time
    (prefill_chunk_size=1: a one-token step can be a padded position; the padding was only zeroed for longer steps)."""
    long, short = torch.randint(3, 512, (1, 9)), torch.randint(3, 512, (1, 5))
    ids = torch.cat([long, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1)])
    mask = torch.cat([torch.ones(1, 9, dtype=torch.long), (ids[1:] != 0).long()])
    alone = greedy(tiny_model, short, 6)[0, -6:]
    for chunk in (1, 2, 64):
        got = greedy(tiny_model, ids, 6, attention_mask=mask, prefill_chunk_size=chunk)
        assert torch.equal(got[1, -6:], alone), chunk


def test_attention_mask_holes_are_refused_and_right_padding_is_not(tiny_model):
    """A mask with masked tokens between attended ones has no exact meaning for a recurrent state (it still decays
    across the hole): a clear error instead of a silently different result; right padding (training) passes."""
    ids = torch.randint(3, 512, (2, 10))
    hole = torch.ones(2, 10, dtype=torch.long)
    hole[1, 4] = 0
    with torch.no_grad(), pytest.raises(ValueError, match="position 4 of row 1 between attended tokens"):
        tiny_model(ids, attention_mask=hole)
    right = torch.ones(2, 10, dtype=torch.long)
    right[1, 7:] = 0
    with torch.no_grad():
        assert_close_logits(tiny_model(ids, attention_mask=right).logits[1, :7], tiny_model(ids[1:, :7]).logits[0])


def test_offloaded_latents_give_the_same_tokens(tiny_model):
    ids = torch.randint(3, 512, (1, 12))
    cache = KimiK3HybridCache(tiny_model.config, offload_latents_to="cpu")
    assert torch.equal(greedy(tiny_model, ids, 8, past_key_values=cache), greedy(tiny_model, ids, 8))
    assert all(layer.latent.device.type == "cpu" for layer in cache.layers if hasattr(layer, "latent"))


def test_cache_save_and_load_resume_exactly(tiny_model, tmp_path):
    ids = torch.randint(3, 512, (2, 40))
    cache = KimiK3HybridCache(tiny_model.config)
    with torch.no_grad():
        tiny_model(ids[:, :39], past_key_values=cache, use_cache=True)
        path = tmp_path / "session.safetensors"
        cache.save(path)
        want = tiny_model(ids[:, 39:], past_key_values=cache, use_cache=True).logits
        restored = KimiK3HybridCache.load(path, tiny_model.config)
        assert restored.get_seq_length() == 39
        got = tiny_model(ids[:, 39:], past_key_values=restored, use_cache=True).logits
    assert torch.equal(want, got)
    assert not list(tmp_path.glob(".tmp-*"))


def test_cache_from_another_architecture_is_refused(tiny_model, tmp_path):
    cache = KimiK3HybridCache(tiny_model.config)
    with torch.no_grad():
        tiny_model(torch.randint(3, 512, (1, 5)), past_key_values=cache, use_cache=True)
    cache.save(tmp_path / "c.safetensors")
    other = KimiK3TextConfig.tiny(kv_lora_rank=16)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        KimiK3HybridCache.load(tmp_path / "c.safetensors", other)


# ---------------------------------------------------------------- packed sequences
def test_packed_sequences_equal_separate_sequences(tiny_model):
    """One row holding three sequences (position_ids restart at 0, as DataCollatorWithFlattening makes them):
    KDA state and conv windows reset at the boundaries and MLA does not attend across them."""
    lengths = (7, 70, 20)
    rows = [torch.randint(3, 512, (n,)) for n in lengths]
    packed = torch.cat(rows)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        got = tiny_model(packed, position_ids=position_ids).logits[0]
        want = torch.cat([tiny_model(r[None]).logits[0] for r in rows])
    assert_close_logits(got, want)
    # the collator's explicit cu_seq_lens give the same result
    cu = torch.tensor([0, 7, 77, 97], dtype=torch.int32)
    with torch.no_grad():
        got_cu = tiny_model(packed, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                            max_length_q=70, max_length_k=70).logits[0]
    assert_close_logits(got_cu, want)


FP32_PARAMETERS = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


def test_bf16_load_keeps_fp32_parameters(tmp_path, tiny_model):
    """Loading (and building) in bf16 keeps in fp32 what the release stores in fp32 (K3_SPEC.md 2.2): the KDA decay
    parameters, the short convolutions' filters, the KDA output norm's weight, the selection bias; the filters and
    norm weights are the checkpoint's values, not bf16 roundings of them."""
    tiny_model.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    saved = tiny_model.state_dict()
    for name, tensor in model.state_dict().items():
        want = torch.float32 if name.endswith(FP32_PARAMETERS) else torch.bfloat16
        assert tensor.dtype == want, name
        if "conv1d" in name or "o_norm" in name:
            assert torch.equal(tensor, saved[name]), name
    built = AutoModelForCausalLM.from_config(tiny_model.config, dtype=torch.bfloat16)
    for name, tensor in built.state_dict().items():
        assert (tensor.dtype == torch.float32) == name.endswith(FP32_PARAMETERS), name
    # a later cast casts them too, as transformers' `_keep_in_fp32_modules_strict` does for every model
    cast = AutoModelForCausalLM.from_pretrained(tmp_path).to(torch.bfloat16)
    assert all(tensor.dtype == torch.bfloat16 for tensor in cast.state_dict().values())


def test_preallocated_cache_stores_the_activations_dtype(tiny_model):
    """A cache reserved with batch_size but no dtype (the activations' dtype unknown at construction) stores a bf16
    model's latents in bf16, as documented (it kept fp32 buffers: twice the memory), with the reserved capacity and
    the same tokens; a batch size below 1 is refused."""
    model = copy.deepcopy(tiny_model).bfloat16()
    ids = torch.randint(3, 512, (2, 12))
    cache = KimiK3HybridCache(model.config, max_cache_len=64, batch_size=2)
    assert torch.equal(greedy(model, ids, 5, past_key_values=cache), greedy(model, ids, 5))
    latents = [layer.latent for layer in cache.layers if hasattr(layer, "latent")]
    assert all(t.dtype == torch.bfloat16 and t.shape[1] == 64 for t in latents)
    with pytest.raises(ValueError, match="`batch_size` must be a positive"):
        KimiK3HybridCache(model.config, batch_size=0)
    # reset() empties the cache but keeps what the user set up: the reserved buffers, past recording
    cache.activate_past_recording()
    cache.reset()
    assert cache.get_seq_length() == 0
    assert all(layer.latent is t for layer, t in zip((l for l in cache.layers if hasattr(l, "latent")), latents))
    assert all(layer.record_past for layer in cache.layers if hasattr(layer, "conv_state"))
    assert torch.equal(greedy(model, ids, 5, past_key_values=cache), greedy(model, ids, 5))


def test_preallocated_cache_with_storage_dtype(tiny_model):
    """A cache built explicitly (batch, max length, dtype, device) reserves its latent buffers at construction,
    never regrows within max_cache_len, stores the latent in the requested dtype, and decodes like the default one
    (bf16 storage within bf16 rounding of the latent)."""
    ids = torch.randint(3, 512, (2, 20))
    cache = KimiK3HybridCache(tiny_model.config, max_cache_len=32, batch_size=2, device="cpu")
    buffers = [layer.latent for layer in cache.layers if hasattr(layer, "latent")]
    assert all(b is not None and b.shape[:2] == (2, 32) for b in buffers)
    out = greedy(tiny_model, ids, 10, past_key_values=cache)
    assert torch.equal(out, greedy(tiny_model, ids, 10))
    assert all(layer.latent is b for layer, b in zip((l for l in cache.layers if hasattr(l, "latent")), buffers))
    assert cache.get_seq_length() == 29

    with torch.no_grad():
        want = tiny_model(ids, past_key_values=KimiK3HybridCache(tiny_model.config), use_cache=True)
        half = KimiK3HybridCache(tiny_model.config, dtype=torch.bfloat16)
        got = tiny_model(ids, past_key_values=half, use_cache=True)
        step = torch.randint(3, 512, (2, 1))
        a = tiny_model(step, past_key_values=want.past_key_values, use_cache=True).logits
        b = tiny_model(step, past_key_values=half, use_cache=True).logits
    assert all(layer.latent.dtype == torch.bfloat16 for layer in half.layers if hasattr(layer, "latent"))
    assert (a - b).abs().max() <= 2e-2 * a.abs().max()

    with pytest.raises(ValueError, match="preallocated for batch 3"):
        tiny_model(ids, past_key_values=KimiK3HybridCache(tiny_model.config, batch_size=3), use_cache=True)
    with pytest.raises(ValueError, match="max_cache_len"):
        KimiK3HybridCache(tiny_model.config, max_cache_len=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_three_op_form_bitwise(dtype):
    """KimiK3RMSNorm and KimiK3GatedRMSNorm (F.rms_norm inside) against the form the reference writes out
    (SGLang's RMSNorm.forward_native: fp32 ``x * rsqrt(mean(x^2) + eps)``, times the weight in fp32, rounded once), at
    decode, prompt and odd widths and magnitudes: the same bits forward, gradients within fp32 rounding."""
    from transformers_k3.modeling_kimi_k3 import KimiK3GatedRMSNorm, KimiK3RMSNorm

    gen = torch.Generator().manual_seed(0)
    for hidden, shape, scale in [(128, (1, 1), 1.0), (100, (2, 7), 1e3), (7168, (3, 5), 1e-3), (16, (4, 300), 1.0)]:
        norm = KimiK3RMSNorm(hidden, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(hidden, generator=gen))
        norm = norm.to(dtype)
        x = (torch.randn(*shape, hidden, generator=gen) * scale).to(dtype).requires_grad_()
        x32 = x.float()
        want = ((x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)) * norm.weight.float()).to(dtype)
        got = norm(x)
        assert torch.equal(got, want)
        probe = torch.randn(got.shape, generator=gen).to(dtype)
        (g_want,) = torch.autograd.grad((want.float() * probe.float()).sum(), x)
        (g_got,) = torch.autograd.grad((got.float() * probe.float()).sum(), x)
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6 * g_want.abs().max().item())
        # the gated norm on KDA's output: the same normalisation, then weight and sigmoid gate in fp32
        gated = KimiK3GatedRMSNorm(hidden, eps=1e-5)
        with torch.no_grad():
            gated.weight.copy_(torch.randn(hidden, generator=gen))
        gate = torch.randn(x.shape, generator=gen).to(dtype)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
        want = (gated.weight.float() * normed * torch.sigmoid(gate.float())).to(dtype)
        assert torch.equal(gated(x, gate), want)
