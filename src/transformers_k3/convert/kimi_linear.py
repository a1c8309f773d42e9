"""Kimi Linear checkpoints -> K3 with every K3-only feature off, streamed shard by shard.

Two source layouts are accepted (detected per tensor, so either works):

* Moonshot's original release (the official names of K3_SPEC.md section 2: ``block_sparse_moe``,
  per-expert ``w1``/``w2``/``w3``, ``q_conv1d``/``k_conv1d``/``v_conv1d``, ``A_log`` ``[1, 1, nh, 1]``);
* transformers' in-tree ``KimiLinearForCausalLM`` state dict (``self_attn.conv1d.weight`` holding q|k|v,
  ``self_attn.forget_gate.*``, fused ``mlp.experts.gate_up_proj``/``down_proj``).

The config becomes a `KimiK3TextConfig` that computes what transformers' Kimi Linear computes: no Block
Attention Residuals, experts at full width without the latent norm, SiLU-GLU, the softplus forget gate
(``gate_lower_bound: null``), the low-rank KDA output gate, no MLA output gate, and transformers' norm
epsilons (1e-6 for the MLA ``q_a``/``kv_a`` norms, ``rms_norm_eps`` for the KDA output norm). The logits
then match ``KimiLinearForCausalLM`` on the same weights to fp32 rounding.
"""

from __future__ import annotations


from ..configuration_kimi_k3 import KimiK3TextConfig, is_k3_text_config_dict
from ..safetensors_header import CheckpointError, TensorInfo
from .official import ConversionPlan, plan_official_conversion, resolve_dtype, write_k3_config, writing_checkpoint
from ..conversion.streaming import Checkpoint


def kimi_linear_config_to_k3(kimi_linear) -> KimiK3TextConfig:
    """A transformers ``KimiLinearConfig`` (or a Kimi Linear ``config.json`` dict, either naming) -> the
    `KimiK3TextConfig` of the same model."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    if isinstance(kimi_linear, dict):
        if is_k3_text_config_dict(kimi_linear) or kimi_linear.get("model_type") in ("kimi_k3", "kimi_k3_text"):
            raise CheckpointError("this config uses K3-only features: convert it with convert_k3_official_to_hf.py")
        kimi_linear = KimiLinearConfig(**{k: v for k, v in kimi_linear.items() if k not in ("model_type", "auto_map")})
    kl = kimi_linear
    if kl.hidden_act != "silu":
        raise CheckpointError(f"Kimi Linear config: hidden_act {kl.hidden_act!r} is not supported (expected 'silu')")
    layer_types = list(kl.layer_types)
    mlp_types = list(kl.mlp_layer_types)
    first_dense = mlp_types.index("sparse") if "sparse" in mlp_types else len(mlp_types)
    if any(t != "sparse" for t in mlp_types[first_dense:]):
        raise CheckpointError(f"Kimi Linear config: dense layers after the first MoE layer ({mlp_types}) are not supported")
    eos = kl.eos_token_id
    return KimiK3TextConfig(
        vocab_size=kl.vocab_size, hidden_size=kl.hidden_size, intermediate_size=kl.intermediate_size,
        num_hidden_layers=kl.num_hidden_layers, num_attention_heads=kl.num_attention_heads,
        q_lora_rank=kl.q_lora_rank, kv_lora_rank=kl.kv_lora_rank, qk_nope_head_dim=kl.qk_nope_head_dim,
        qk_rope_head_dim=kl.qk_rope_head_dim, v_head_dim=kl.v_head_dim, mla_use_nope=True, mla_use_output_gate=False,
        hidden_act="silu", activation_situ_beta=None, activation_situ_linear_beta=None, rms_norm_eps=kl.rms_norm_eps,
        num_experts=kl.num_local_experts, num_experts_per_token=kl.num_experts_per_tok,
        num_shared_experts=kl.n_shared_experts, moe_intermediate_size=kl.moe_intermediate_size,
        routed_expert_hidden_size=None, latent_moe_use_norm=False, first_k_dense_replace=first_dense, moe_layer_freq=1,
        moe_router_activation_func="sigmoid", moe_renormalize=kl.norm_topk_prob,
        routed_scaling_factor=kl.routed_scaling_factor, topk_method="noaux_tc", num_expert_group=kl.n_group,
        topk_group=kl.topk_group, attn_res_block_size=None, tie_word_embeddings=kl.tie_word_embeddings,
        pad_token_id=kl.pad_token_id, bos_token_id=kl.bos_token_id, eos_token_id=eos,
        max_position_embeddings=getattr(kl, "max_position_embeddings", 1048576), initializer_range=kl.initializer_range,
        mla_latent_norm_eps=1e-6, kda_o_norm_eps=kl.rms_norm_eps,
        linear_attn_config={
            "kda_layers": [i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(layer_types) if t != "linear_attention"],
            "num_heads": kl.linear_num_heads, "head_dim": kl.linear_head_dim,
            "short_conv_kernel_size": kl.linear_conv_kernel_dim, "use_full_rank_gate": False, "gate_lower_bound": None,
        },
    )


def official_view(source: Checkpoint, config: KimiK3TextConfig) -> dict[str, tuple[TensorInfo, tuple | None]]:
    """The checkpoint's tensors under official names: in-tree names are renamed, and the fused q|k|v
    ``conv1d`` becomes three sliced views. Moonshot names pass through unchanged."""
    proj = config.linear_num_heads * config.linear_head_dim
    view: dict[str, tuple[TensorInfo, tuple | None]] = {}
    for name, info in source.tensors.items():
        if name.endswith("self_attn.conv1d.weight"):
            if info.shape[0] != 3 * proj:
                raise CheckpointError(f"{info.where()}: wrong shape {list(info.shape)}, a fused q|k|v conv needs "
                                      f"[{3 * proj}, 1, {config.linear_conv_kernel_size}]")
            stem = name[: -len("conv1d.weight")]
            for i, part in enumerate("qkv"):
                sliced = TensorInfo(info.file, info.name, info.dtype, (proj, *info.shape[1:]), info.offset)
                view[f"{stem}{part}_conv1d.weight"] = (sliced, (slice(i * proj, (i + 1) * proj),))
            continue
        view[name.replace("self_attn.forget_gate.", "self_attn.")] = (info, None)
    return view


def convert_kimi_linear_checkpoint(input_dir, output_dir=None, dtype: str = "bf16", dry_run: bool = False,
                                   max_shard_size: int | str = "5GB", overwrite: bool = False,
                                   progress: bool = True) -> ConversionPlan:
    """Converts a Kimi Linear directory (either layout) to a K3 checkpoint in our layout."""
    source = Checkpoint(input_dir)
    try:
        config = kimi_linear_config_to_k3(source.config)
    except CheckpointError as error:
        raise CheckpointError(f"{source.directory / 'config.json'}: {error}") from error
    except Exception as error:  # transformers' config classes raise TypeError/ValueError/AttributeError/...
        raise CheckpointError(f"{source.directory / 'config.json'}: not a valid Kimi Linear config "
                              f"({type(error).__name__}: {error}); fix the file or re-download it") from error
    plan = plan_official_conversion(source, dtype, config=config, view=official_view(source, config))
    if dry_run:
        return plan
    with writing_checkpoint(source, plan, output_dir, overwrite, max_shard_size, progress) as tmp:
        write_k3_config(config, False, tmp, resolve_dtype(dtype))
    return plan


__all__ = ["convert_kimi_linear_checkpoint", "kimi_linear_config_to_k3", "official_view"]
