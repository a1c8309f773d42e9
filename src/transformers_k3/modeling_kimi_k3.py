"""Kimi K3 text model: composition only. Each idea lives in its own module under `layers/`; this file
wires them in the order a token flows through the network (K3_SPEC.md section 3.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass


import torch
from torch import nn
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.integrations.accelerate import force_accelerate_hooks
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ._compat import MASK_CACHE_KWARG, OUTPUT_CACHE_FIELD, either_cache, output_cache
from .cache import KimiK3HybridCache
from .configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig, check_config_for_dtype
from .layers.attn_res import KimiK3AttnResRead
from .conversion.release_format import KimiK3ReleaseFormatMixin
from .layers.kda import KimiK3DeltaAttention
from .layers.mla import KimiK3MLA, uses_blockwise_attention
from .layers.moe import K3_GROUPED_MM, KimiK3Experts, KimiK3MLP, KimiK3Router, KimiK3SparseMoE, router_aux_loss
from .layers.norm import KimiK3GatedRMSNorm, KimiK3RMSNorm
from .generation_kimi_k3 import (KimiK3GenerationMixin, KimiK3InputError, _host_reads_are_free, _input_ids_problem,
                                  _mask_problems, _padding_problem, _position_problems, _raise_problems)


@dataclass
class KimiK3ModelOutputWithPast(MoeModelOutputWithPast):
    r"""attn_res_weights (`tuple[torch.FloatTensor]`, *optional*, returned with `output_attn_res_weights=True`):
        The depth-softmax weights of every AttnRes read in execution order (attention side and FFN side of each
        layer, then the final read), each `[num_candidates, batch, seq]`: which block snapshots a sublayer reads."""

    attn_res_weights: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class KimiK3CausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""attn_res_weights (`tuple[torch.FloatTensor]`, *optional*): see `KimiK3ModelOutputWithPast`."""

    attn_res_weights: tuple[torch.FloatTensor, ...] | None = None


class KimiK3StoredWeight(nn.Module):
    """A checkpoint tensor the computation never reads, kept as a persistent buffer named ``weight`` so that the
    official key (e.g. ``layers.0.self_attention_res_proj.weight``) loads and saves unchanged."""

    def __init__(self, shape: tuple[int, ...], initial: float):
        super().__init__()
        self.register_buffer("weight", torch.full(shape, initial))
        self._initial = initial



def packed_sequence_boundaries(position_ids, cu_seq_lens_q, attention_mask, past_key_values,
                               batch_size: int) -> torch.LongTensor | None:
    """``cu_seqlens`` of a packed batch (several sequences concatenated in one row, as transformers'
    `DataCollatorWithFlattening` produces), or None. Taken from the collator's ``cu_seq_lens_q`` when given,
    else from ``position_ids`` restarting at 0. MLA gets the matching block-diagonal mask from
    `create_causal_mask`, which detects the same packing from ``position_ids``."""
    if batch_size != 1 or past_key_values is not None or attention_mask is not None:
        return None
    if cu_seq_lens_q is not None:
        return cu_seq_lens_q.to(torch.long)
    if position_ids is None:
        return None
    positions = position_ids.reshape(-1)
    if torch.compiler.is_compiling():
        # A graph cannot branch on whether the row is packed: it always takes the starts (position 0, and token 0),
        # their count an unbacked size; a single sequence gives [0, T], which computes what None does.
        first = torch.arange(positions.numel(), device=positions.device) == 0
        starts = ((positions == 0) | first).nonzero().flatten()
        torch._check(starts.numel() >= 1)  # (token 0 starts a sequence: the size's bound, for the checks downstream)
        return torch.cat([starts, starts.new_full((1,), positions.numel())])
    starts = (positions == 0).nonzero().flatten()
    if starts.numel() <= 1 and positions[0] == 0:
        return None
    if starts.numel() == 0 or starts[0] != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    return torch.cat([starts, starts.new_tensor([positions.numel()])])


class KimiK3DecoderLayer(GradientCheckpointingLayer):
    """One K3 layer. Its input is the AttnRes state: the running partial sum ``p`` of the current block and
    the bank of earlier block snapshots. With AttnRes off the bank stays empty and each read returns ``p``,
    which is exactly the classic pre-norm residual stream."""

    def __init__(self, config: KimiK3TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if self.layer_type == "linear_attention":
            self.self_attn = KimiK3DeltaAttention(config, layer_idx)
        else:
            self.self_attn = KimiK3MLA(config, layer_idx)
        self.mlp = KimiK3SparseMoE(config) if config.is_moe_layer(layer_idx) else KimiK3MLP(config)
        self.input_layernorm = KimiK3RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = KimiK3RMSNorm(hidden, eps=eps)
        self.use_attn_res = config.use_attn_res
        self.self_attention_res_norm = self.self_attention_res_proj = self.mlp_res_norm = self.mlp_res_proj = None
        if self.use_attn_res:
            self.self_attention_res_norm = KimiK3RMSNorm(hidden, eps=eps)
            self.self_attention_res_proj = nn.Linear(hidden, 1, bias=False)
            self.mlp_res_norm = KimiK3RMSNorm(hidden, eps=eps)
            self.mlp_res_proj = nn.Linear(hidden, 1, bias=False)
            if layer_idx == 0:
                # Layer 0's attention side reads a single candidate (the embeddings), whose softmax weight is 1
                # whatever these hold. The checkpoint has them, so they are kept, as buffers: a parameter that
                # never gets a gradient breaks DDP with `find_unused_parameters=False` (Trainer's choice under
                # gradient checkpointing).
                self.self_attention_res_norm = KimiK3StoredWeight((hidden,), 1.0)
                self.self_attention_res_proj = KimiK3StoredWeight((1, hidden), 0.0)
        # The bank takes a snapshot at the attention side of every S-th layer, after that layer's read.
        self.snapshot = self.use_attn_res and layer_idx % config.attn_res_block_size == 0
        self.attn_side_read = KimiK3AttnResRead(eps)
        self.mlp_side_read = KimiK3AttnResRead(eps)

    # (the AttnRes reads use these weights without calling their modules: accelerate's offload hooks are fired here)
    @force_accelerate_hooks(["self_attention_res_proj", "self_attention_res_norm", "mlp_res_proj", "mlp_res_norm"])
    def forward(self, partial: torch.Tensor, *bank: torch.Tensor, attention_mask=None, past_key_values=None,
                cu_seqlens: torch.LongTensor | None = None, **kwargs) -> tuple[torch.Tensor, ...]:
        """``(partial, *bank) -> (partial, *bank)``; the bank is passed positionally so that gradient
        checkpointing sees every tensor."""
        if self.use_attn_res:
            mix = self.attn_side_read([*bank, partial], self.self_attention_res_proj.weight,
                                      self.self_attention_res_norm.weight)[0]
        else:
            mix = self.attn_side_read([partial])[0]
        x = self.input_layernorm(mix)
        if self.snapshot:
            bank, partial = (*bank, partial), None
        if self.layer_type == "linear_attention":
            # packed sequences: KDA state and conv windows restart at every boundary
            kwargs["cu_seqlens"] = cu_seqlens
        attn_out = self.self_attn(x, attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
        if isinstance(attn_out, tuple):
            attn_out = attn_out[0]
        partial = attn_out if partial is None else partial + attn_out

        if self.use_attn_res:
            mix = self.mlp_side_read([*bank, partial], self.mlp_res_proj.weight, self.mlp_res_norm.weight)[0]
        else:
            mix = partial
        partial = partial + self.mlp(self.post_attention_layernorm(mix))
        return (partial, *bank)


class KimiK3ModelMixin(KimiK3ReleaseFormatMixin):
    """Mixed into K3's pretrained-model classes (text and multimodal): how the experts implementation is chosen, and
    which generation modes the hybrid cache allows."""

    def __init__(self, config, *args, **kwargs):
        # an assignment checks its own field only: the relations between fields are checked here, before building
        validate = getattr(config, "validate", None)
        if validate is not None:
            validate()
            # the dtype being built in (from_pretrained / from_config set it): a factor must not vanish there
            check_config_for_dtype(config, torch.get_default_dtype())
        super().__init__(config, *args, **kwargs)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers looks for the decorator's text in the model's own file; ours sits in layers/moe.py.
        return True

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        # Unset -> "k3_grouped_mm", the fastest correct one here (bench/bench_moe.py); an explicit choice is kept.
        return super().get_correct_experts_implementation(
            K3_GROUPED_MM if requested_experts is None else requested_experts
        )

class KimiK3PreTrainedModel(KimiK3ModelMixin, PreTrainedModel):
    config: KimiK3TextConfig
    config_class = KimiK3TextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiK3DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = False
    # the hybrid cache rolls back (crop), so assisted decoding works: transformers 5.23 reads this flag only to refuse it
    _is_stateful = False
    _can_compile_fullgraph = True  # (prefill and decode through the hybrid cache, the CPU kernels in the graph)
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq", r"rotary_emb\.(cos|sin)_cached"]
    # The release keeps these in fp32 (K3_SPEC.md 2.2): the KDA decay parameters, the KDA short convolutions' filters
    # (which the convolution applies in fp32, section 4.2) and the router's selection bias, whose small
    # Quantile-Balancing updates a bf16 copy would round away.
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "o_norm",
                                    "e_score_correction_bias"]
    _can_record_outputs = {
        "router_logits": OutputRecorder(KimiK3Router, index=0),
        "hidden_states": [
            OutputRecorder(KimiK3AttnResRead, index=0, layer_name="attn_side_read",
                           capture_initial_hidden_state=False),
            OutputRecorder(KimiK3AttnResRead, index=0, layer_name="output_read", capture_initial_hidden_state=False),
        ],
        "attentions": OutputRecorder(KimiK3MLA, index=1),
        "attn_res_weights": OutputRecorder(KimiK3AttnResRead, index=1),
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.get_text_config().initializer_range
        if isinstance(module, KimiK3DeltaAttention):
            # FLA's initialisation: decay rates A in [1, 16], dt in [1e-3, 1e-1] stored as inverse softplus.
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        elif isinstance(module, KimiK3Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, KimiK3Router):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, KimiK3GatedRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, KimiK3StoredWeight):
            init.constant_(module.weight, module._initial)
        elif isinstance(module, KimiK3DecoderLayer) and module.use_attn_res:
            # The paper's init: zero pseudo-queries, so every read starts as the mean of its candidates.
            if isinstance(module.self_attention_res_proj, nn.Linear):
                init.zeros_(module.self_attention_res_proj.weight)
            init.zeros_(module.mlp_res_proj.weight)
        elif isinstance(module, KimiK3Model) and module.config.use_attn_res:
            init.zeros_(module.output_attn_res_proj.weight)

class KimiK3Model(KimiK3PreTrainedModel):
    def __init__(self, config: KimiK3TextConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([KimiK3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.output_attn_res_norm = self.output_attn_res_proj = None
        if config.use_attn_res:
            self.output_attn_res_norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
        self.output_read = KimiK3AttnResRead(config.rms_norm_eps)
        self.norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        # A plain load_state_dict (Trainer's resume) reads the release layout save_pretrained writes.
        from .conversion.hf_mapping import release_layout_pre_hook

        self.register_load_state_dict_pre_hook(release_layout_pre_hook)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @merge_with_config_defaults
    @capture_outputs
    # (the final AttnRes read uses these weights without calling their modules: accelerate's hooks are fired here)
    @force_accelerate_hooks(["output_attn_res_proj", "output_attn_res_norm"])
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: KimiK3HybridCache | None = None,
                inputs_embeds: torch.FloatTensor | None = None, use_cache: bool | None = None,
                cache: KimiK3HybridCache | None = None, **kwargs) -> KimiK3ModelOutputWithPast:
        past_key_values = either_cache(cache, past_key_values)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
        prepared = None
        if isinstance(attention_mask, dict):
            # generate() with a static cache prepares the masks per layer kind (transformers'
            # create_masks_for_generate): MLA's 4-D mask over the cache, KDA's 2-D padding mask over this step
            prepared, attention_mask = attention_mask, attention_mask.get("linear_attention")
        if inputs_embeds is not None and (inputs_embeds.dim() != 3 or 0 in inputs_embeds.shape[:2]):
            raise KimiK3InputError(f"inputs_embeds must be [batch, tokens, hidden] with at least one row and token, "
                                   f"got shape {tuple(inputs_embeds.shape)}")
        # generate() feeds its decode steps its own tokens under a checked mask; off the CPU a cached step's ids are
        # left to the embedding's device-side bounds check: the value checks left are read in one host sync
        if not (isinstance(past_key_values, KimiK3HybridCache) and past_key_values.take_generated_step()):
            # (a Python flag, not the length: a static cache keeps its length on the device inside a compiled step)
            continuing = isinstance(past_key_values, KimiK3HybridCache) and past_key_values.holds_tokens()
            id_problem = (_input_ids_problem(input_ids, self.embed_tokens.num_embeddings,
                                             range_check=not continuing or _host_reads_are_free(input_ids))
                          if inputs_embeds is None else None)
            batch, tokens = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
            packed = batch == 1 and past_key_values is None and attention_mask is None
            _raise_problems([
                id_problem,
                *_mask_problems(attention_mask, batch, tokens),
                _padding_problem(attention_mask) if attention_mask is not None and attention_mask.dim() == 2 else None,
                *_position_problems(position_ids, kwargs.get("cu_seq_lens_q"), tokens, packed),
            ])
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        cu_seqlens = packed_sequence_boundaries(position_ids, kwargs.get("cu_seq_lens_q"), attention_mask,
                                                past_key_values, inputs_embeds.shape[0])
        if use_cache and past_key_values is None and cu_seqlens is None:  # a packed row cannot be continued
            past_key_values = KimiK3HybridCache(self.config)
        if past_key_values is not None and not isinstance(past_key_values, KimiK3HybridCache):
            raise TypeError(
                f"Kimi K3 keeps KDA states and MLA latents in a `KimiK3HybridCache`, got {type(past_key_values).__name__}. "
                "Pass `past_key_values=KimiK3HybridCache(model.config)` or let the model create one (`use_cache=True`)."
            )
        if isinstance(past_key_values, KimiK3HybridCache) and not torch.compiler.is_compiling():
            past_key_values.check_layout(self.config)
            past_key_values.check_not_in_use_elsewhere()
        cache_ids = kwargs.pop("cache_token_ids", input_ids)  # the multimodal model's ids behind its inputs_embeds
        if past_key_values is not None:  # the cache learns what it holds: generate() refuses a prompt not extending it
            past_key_values.record_tokens(cache_ids, inputs_embeds, attention_mask, model=self)
        if position_ids is None and prepared is None:
            # (a static cache gives its offset as a tensor: no length is read inside a compiled step)
            past_seen = past_key_values.get_query_offset() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen
            position_ids = position_ids.unsqueeze(0)

        # The text model is position-free (NoPE MLA, no RoPE in KDA): positions only shape the MLA mask.
        if prepared is not None:
            mla_mask = prepared.get("full_attention")
        elif (cu_seqlens is None and inputs_embeds.shape[1] > 1 and past_key_values is not None
                and past_key_values.get_seq_length() > 0 and not kwargs.get("output_attentions")
                and uses_blockwise_attention(self.config, inputs_embeds)
                and (attention_mask is None or (attention_mask.dim() == 2 and bool(attention_mask.all())))):
            mla_mask = None  # a chunk after cached tokens: MLA masks causally itself, no [T, context] mask
        else:
            mla_mask = create_causal_mask(
                config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                position_ids=position_ids, **{MASK_CACHE_KWARG: past_key_values},
            )
        # (a mask of ones is applied as is: multiplying by one is exact, and finding it all ones would take a sync)
        kda_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None

        state = (inputs_embeds,)  # (partial sum, *bank)
        for layer in self.layers:
            mask = kda_mask if layer.layer_type == "linear_attention" else mla_mask
            state = layer(*state, attention_mask=mask, past_key_values=past_key_values, cu_seqlens=cu_seqlens, **kwargs)

        partial, *bank = state
        if self.config.use_attn_res:
            # under a device_map these two weights may sit on another device than the last layer, and no
            # accelerate hook moves the read's inputs (the read owns no weights)
            device = self.output_attn_res_proj.weight.device
            mix = self.output_read([t.to(device) for t in (*bank, partial)], self.output_attn_res_proj.weight,
                                   self.output_attn_res_norm.weight.to(device))[0]
        else:
            mix = self.output_read([partial])[0]
        return KimiK3ModelOutputWithPast(last_hidden_state=self.norm(mix), **{OUTPUT_CACHE_FIELD: past_key_values})


class KimiK3ForCausalLM(KimiK3PreTrainedModel, KimiK3GenerationMixin, GenerationMixin):
    """K3 text decoder with the LM head. Accepts the text config or, for text-only use of a full K3
    checkpoint, the composite `KimiK3Config` (its ``text_config`` is used)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: KimiK3TextConfig | KimiK3Config):
        if isinstance(config, KimiK3Config):
            config = config.get_text_config()
        super().__init__(config)
        self.model = KimiK3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        # Text-only use of a multimodal checkpoint (e.g. AutoModelForCausalLM on the composite config): its vision
        # weights are not ours to load (the registered conversion mapping drops the text weights' `language_model.`
        # prefix). Only runs when this class is the root model, never inside the multimodal one.
        super()._adjust_missing_and_unexpected_keys(loading_info)
        loading_info.unexpected_keys = {
            key for key in loading_info.unexpected_keys if not key.startswith(("vision_tower.", "mm_projector."))
        }

    @staticmethod
    def _aux_share(labels: torch.Tensor, kwargs: dict) -> torch.Tensor | float:
        """This call's share of the auxiliary balance loss. With ``num_items_in_batch`` (transformers' Trainer under
        gradient accumulation, and across ranks when it averages tokens over devices) the LM loss is this
        micro-batch's summed token losses over the whole batch's count, and the Trainer no longer divides by the
        accumulation steps; the aux loss, a mean over this micro-batch, takes the same share (its target tokens over
        that count), so the accumulated total is the token-weighted mean of the micro-batches' aux losses instead
        of their sum (it was multiplied by the accumulation steps). Otherwise 1."""
        num_items = kwargs.get("num_items_in_batch")
        if num_items is None:
            return 1.0
        shifted = kwargs.get("shift_labels")
        if shifted is None:
            shifted = labels[..., 1:]
        return (shifted != -100).sum() / num_items

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: KimiK3HybridCache | None = None,
                inputs_embeds: torch.FloatTensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                cache: KimiK3HybridCache | None = None, **kwargs) -> KimiK3CausalLMOutputWithPast:
        aux_coef = self.config.router_aux_loss_coef  # optional balance loss (off by default; K3 uses the bias)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=either_cache(cache, past_key_values), inputs_embeds=inputs_embeds, use_cache=use_cache,
            **({"output_router_logits": True, **kwargs} if aux_coef else kwargs),
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        aux_loss = None
        if aux_coef and outputs.router_logits:
            aux_loss = router_aux_loss(
                outputs.router_logits, [m for m in self.model.modules() if isinstance(m, KimiK3Router)],
                batch_size=outputs.last_hidden_state.shape[0],
                attention_mask=attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None,
            )
            if loss is not None:
                loss = loss + aux_coef * self._aux_share(labels, kwargs) * aux_loss.to(loss.device)
        return KimiK3CausalLMOutputWithPast(
            loss=loss, aux_loss=aux_loss, logits=logits, **{OUTPUT_CACHE_FIELD: output_cache(outputs)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions, router_logits=outputs.router_logits,
            attn_res_weights=outputs.attn_res_weights,
        )


__all__ = ["KimiK3PreTrainedModel", "KimiK3Model", "KimiK3ForCausalLM", "KimiK3DecoderLayer"]
