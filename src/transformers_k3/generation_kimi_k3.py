"""Generation plumbing for K3's generating classes (text and multimodal): the hybrid-cache choice for generate(),
the checks on what generate() and the model are given (`KimiK3InputError`), and continuing from a filled cache.
Kept out of the modeling file, which holds the network only."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from ._compat import CACHE_KWARG, either_cache
from .cache import KimiK3CacheError, KimiK3CacheSizeError, KimiK3HybridCache, check_cache_fits

def _padding_problem(attention_mask: torch.Tensor):
    """A 2-D attention mask may mask tokens before a row's first attended one (left padding) or after its last (right
    padding), not between attended ones: the KDA layers' recurrent state would still decay across a masked hole
    and their short convolutions would see it as zeros, so the result would be neither the sequence with those
    tokens nor the one without them. Returns (a flag on the mask's device: it has a hole, what raises then) for
    `_raise_problems`."""
    attended = attention_mask.bool()
    started = attended.long().cummax(dim=1).values.bool()
    more_later = attended.flip(1).long().cummax(dim=1).values.flip(1).bool()
    holes = started & more_later & ~attended

    def fail():
        row, position = (int(i) for i in holes.nonzero()[0])
        raise ValueError(
            f"attention_mask masks position {position} of row {row} between attended tokens; K3's KDA layers (a "
            "recurrent state) take only padding at a row's ends (left padding; right padding in training, not in generate()), "
            "not holes: drop those tokens from the input instead (if generate inferred this mask from pad_token_id "
            "because the ids contain the pad id, pass the attention_mask explicitly)")

    return holes.any(), fail


def _host_reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether reading `tensor`'s values on the host costs no device sync (it is in host memory)."""
    return tensor.device.type == "cpu"


def _raise_problems(problems: list) -> None:
    """Read the (flag, raise) pairs' flags in one host transfer (one sync on a GPU, whatever their number) and raise
    the first problem found."""
    problems = [problem for problem in problems if problem is not None]
    if problems:
        device = problems[0][0].device
        for found, (_, fail) in zip(torch.stack([flag.to(device) for flag, _ in problems]).tolist(), problems):
            if found:
                fail()


class KimiK3InputError(ValueError):
    """Model or generate() inputs K3 cannot compute a right answer from (no tokens, ids outside the vocabulary,
    right padding in generation, a prefill chunk size that is not a token count)."""


def check_input_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Token ids K3's embedding can look up: an integer tensor with at least one position, every id in
    ``[0, vocab_size)``. Skipped while compiling (the range check reads the tensor's values)."""
    _raise_problems([_input_ids_problem(input_ids, vocab_size)])


def _ids_shape_message(input_ids: torch.Tensor) -> str:
    return (f"input_ids must be [batch, tokens] with at least one row and one token, got shape "
            f"{tuple(input_ids.shape)}: a single sequence goes in as ids[None] (shape [1, tokens])")


def _mask_problems(attention_mask, batch: int, tokens: int) -> list:
    """A 2-D attention mask that does not cover the input (another batch, fewer positions than tokens) raises now;
    one holding other values than 0 and 1 (K3 multiplies by it: 2 or 0.5 would weight a token instead of masking
    it) is returned as (flag, raise) for `_raise_problems` (not while compiling: it reads the values)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return []
    if attention_mask.shape[0] != batch or attention_mask.shape[1] < tokens:
        raise KimiK3InputError(
            f"attention_mask of shape {tuple(attention_mask.shape)} does not cover input_ids of shape "
            f"({batch}, {tokens}): pass one mask row per sequence with a position for every token (and for every "
            "token a cache holds before them)")
    if attention_mask.dtype == torch.bool or torch.compiler.is_compiling() or attention_mask.device.type == "meta":
        return []
    bad = (attention_mask != 0) & (attention_mask != 1)

    def fail():
        row, position = (int(i) for i in bad.nonzero()[0])
        raise KimiK3InputError(
            f"attention_mask must hold only 0 and 1 (or be a bool tensor), got {attention_mask[row, position].item()} "
            f"at row {row}, position {position}: K3 multiplies its states by the mask, so another value weights a "
            "token instead of masking it. Pass 1 for a token, 0 for padding")

    return [(bad.any(), fail)]


def _position_problems(position_ids, cu_seq_lens_q, tokens: int, packed: bool) -> list:
    """position_ids that cannot be positions (not integers, another length than the tokens) raise now. In a packed
    row (`packed`: one row, no cache, no mask), where they say where each sequence starts, these are returned as
    (flag, raise) for `_raise_problems`: a negative position, a step other than +1 or a restart at 0, and
    ``cu_seq_lens_q`` that do not increase from 0 to the token count or disagree with the starts position_ids give
    (they used to win silently). Not while compiling (they read the values)."""
    if position_ids is not None:
        if position_ids.dtype.is_floating_point or position_ids.dtype.is_complex or position_ids.dtype == torch.bool:
            raise KimiK3InputError(f"position_ids must hold integer positions, got a {position_ids.dtype} tensor: "
                                   "pass torch.long positions (or none: K3's text model does not need them)")
        if position_ids.dim() == 0 or position_ids.shape[-1] != tokens:
            raise KimiK3InputError(f"position_ids of shape {tuple(position_ids.shape)} do not give one position per "
                                   f"token ({tokens} tokens): pass [batch, tokens] positions, or none")
    if cu_seq_lens_q is not None and (cu_seq_lens_q.dim() != 1 or cu_seq_lens_q.shape[0] < 2):
        raise KimiK3InputError(f"cu_seq_lens_q must be a 1-D tensor of sequence boundaries [0, ..., tokens], got "
                               f"shape {tuple(cu_seq_lens_q.shape)}")
    if not packed or torch.compiler.is_compiling():
        return []
    problems, starts = [], None
    if position_ids is not None and position_ids.device.type != "meta":
        positions = position_ids.reshape(-1)
        if positions.numel() != tokens:
            raise KimiK3InputError(f"position_ids of shape {tuple(position_ids.shape)} give {positions.numel()} "
                                   f"positions for a packed row of {tokens} tokens: pass [1, tokens] positions")
        following = positions[1:]
        wrong = torch.cat([positions[:1] < 0, (following != positions[:-1] + 1) & (following != 0)])

        def fail_positions():
            index = int(wrong.nonzero()[0])
            after = f" after {int(positions[index - 1])}" if index else ""
            raise KimiK3InputError(
                f"position_ids of a packed row must count 0, 1, 2, ... within each sequence and restart at 0 for the "
                f"next (DataCollatorWithFlattening's form), got {int(positions[index])} at token {index}{after}")

        problems.append((wrong.any(), fail_positions))
        starts = positions == 0
        starts[0] = True
    if cu_seq_lens_q is not None and cu_seq_lens_q.device.type != "meta":
        cu = cu_seq_lens_q.to(torch.long)
        malformed = (cu[0] != 0) | (cu[-1] != tokens) | (cu[1:] <= cu[:-1]).any()

        def fail_form():
            raise KimiK3InputError(f"cu_seq_lens_q must increase from 0 to the row's {tokens} tokens, got "
                                   f"{cu.tolist()[:20]}")

        problems.append((malformed, fail_form))
        if starts is not None:
            given = torch.zeros_like(starts)
            given[cu[:-1].clamp(0, tokens - 1).to(starts.device)] = True

            def fail_disagree():
                raise KimiK3InputError(
                    f"cu_seq_lens_q {cu.tolist()[:20]} and position_ids (sequences starting at tokens "
                    f"{starts.nonzero().flatten().tolist()[:20]}) disagree on where the packed sequences start: pass "
                    "the collator's values together, or only position_ids")

            problems.append(((starts != given).any(), fail_disagree))
    return problems


PACKED_FROM_CACHE = (
    "a KimiK3HybridCache holds one sequence's state per row, so a row packing several sequences ({what}, as "
    "DataCollatorWithFlattening makes them) cannot run from it: the KDA states and MLA latents would carry one "
    "sequence into the next. Run a packed row without past_key_values (the model restarts the state at each "
    "sequence), or give each sequence its own row of input_ids and continue the rows from one cache over the batch; "
    "to train packed rows in segments use transformers_k3.segments.segment_backward, which takes the packing keys")


def _several_sequences(kwargs: dict) -> str | None:
    """Which of the collator's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` marks more than one sequence, in words, or None."""
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        cu = kwargs.get(name)
        if isinstance(cu, torch.Tensor) and cu.numel() > 2:
            return f"{name} of {cu.numel() - 1} sequences"
    return None


def _packed_from_cache_problems(position_ids, kwargs: dict, tokens: int) -> list:
    """A row packing several sequences given with a cache (and no attention mask, the packed form): ``cu_seq_lens_*``
    of more than one sequence raise now; position_ids restarting at 0 after a row's first token are returned as
    (flag, raise) for `_raise_problems` (not while compiling, nor for a one-token step: it reads the values)."""
    several = _several_sequences(kwargs)
    if several:
        raise KimiK3InputError(PACKED_FROM_CACHE.format(what=several))
    if (position_ids is None or tokens < 2 or position_ids.dim() == 0 or torch.compiler.is_compiling()
            or position_ids.device.type == "meta"):
        return []
    restarts = position_ids.reshape(-1, position_ids.shape[-1])[:, 1:] == 0

    def fail():
        row, token = (int(i) for i in restarts.nonzero()[0])
        raise KimiK3InputError(PACKED_FROM_CACHE.format(
            what=f"position_ids restarting at 0 at token {token + 1} of row {row}"))

    return [(restarts.any(), fail)]


PACKED_ROWS = (
    "K3's KDA layers take packed sequences in one row only: {batch} rows whose position_ids break ({what}) would "
    "run each row's KDA state from one sequence into the next while transformers' mask splits its MLA attention at "
    "the break. Put the packed sequences in one row of shape [1, tokens] (as DataCollatorWithFlattening does), give "
    "each sequence its own row with an attention_mask over the padding, or pass position_ids that step by +1")


def _packed_rows_problems(position_ids, kwargs: dict, batch: int, tokens: int) -> list:
    """Several rows with no cache and no mask that pack several sequences each: ``cu_seq_lens_*`` of more than one
    sequence raise now; position_ids that do not step by +1 (where transformers' `find_packed_sequence_indices`
    splits the mask) are returned as (flag, raise) for `_raise_problems` (not while compiling: it reads the values)."""
    several = _several_sequences(kwargs)
    if several:
        raise KimiK3InputError(PACKED_ROWS.format(batch=batch, what=several))
    if (position_ids is None or tokens < 2 or position_ids.dim() == 0 or torch.compiler.is_compiling()
            or position_ids.device.type == "meta"):
        return []
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    breaks = rows[:, 1:] != rows[:, :-1] + 1

    def fail():
        row, token = (int(i) for i in breaks.nonzero()[0])
        raise KimiK3InputError(PACKED_ROWS.format(batch=batch, what=(
            f"from {int(rows[row, token])} to {int(rows[row, token + 1])} at token {token + 1} of row {row}")))

    return [(breaks.any(), fail)]


def _input_ids_problem(input_ids: torch.Tensor, vocab_size: int, range_check: bool = True):
    """`check_input_ids`'s form checks, raised now, and its range check as (flag, raise) for `_raise_problems`
    (None without `range_check`, while compiling or on meta)."""
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise KimiK3InputError(f"input_ids must hold integer token ids, got a {input_ids.dtype} tensor; pass the "
                               "tokenizer's ids (a float tensor of vectors goes in as inputs_embeds)")
    if input_ids.dim() == 2 and input_ids.shape[0] > 0 and input_ids.shape[1] == 0:
        raise KimiK3InputError(
            f"input_ids has no tokens (shape {tuple(input_ids.shape)}): pass at least one token; to start from "
            "nothing, pass the tokenizer's bos_token_id as a [batch, 1] tensor")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise KimiK3InputError(_ids_shape_message(input_ids))
    if not range_check or torch.compiler.is_compiling() or input_ids.device.type == "meta":
        return None
    bad = (input_ids.detach() < 0) | (input_ids.detach() >= vocab_size)

    def fail():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise KimiK3InputError(
            f"input_ids holds id {int(input_ids[where])} at position {where}, outside this model's vocabulary "
            f"[0, {vocab_size}): the tokenizer and the checkpoint disagree. Use the tokenizer saved with the "
            "checkpoint; after adding tokens to a tokenizer, call model.resize_token_embeddings(len(tokenizer))")

    return bad.any(), fail


def _check_generation_inputs(args: tuple, kwargs: dict) -> None:
    """What generate() cannot continue correctly: no tokens, or a batch whose rows end in padding (K3's KDA
    layers would carry their recurrent state across the pads into the new tokens)."""
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    integer_ids = isinstance(ids, torch.Tensor) and not ids.dtype.is_floating_point
    if integer_ids and ids.dim() == 2 and ids.shape[0] > 0 and ids.shape[-1] == 0:
        raise KimiK3InputError(
            f"generate() got input_ids with no tokens (shape {tuple(ids.shape)}): pass at least one token (a chat "
            "prompt, or the tokenizer's bos_token_id as a [batch, 1] tensor)")
    if integer_ids and (ids.dim() != 2 or ids.shape[0] == 0):
        raise KimiK3InputError(_ids_shape_message(ids))
    mask = kwargs.get("attention_mask")
    if integer_ids and isinstance(mask, torch.Tensor):  # (generate() checks once, before its first step)
        _raise_problems(_mask_problems(mask, ids.shape[0], ids.shape[1]))
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] > 0:
        empty = ~mask.bool().any(dim=-1)
        if bool(empty.any()):
            row = int(empty.nonzero()[0])
            raise KimiK3InputError(f"attention_mask row {row} attends to no token: every row needs at least one "
                                   "token to generate from")
        ends_padded = ~mask[:, -1].bool()
        if bool(ends_padded.any()):
            row = int(ends_padded.nonzero()[0])
            raise KimiK3InputError(
                f"attention_mask row {row} ends in padding (right padding): generated tokens would follow the pads, "
                "and K3's KDA layers carry their state across them. Use left padding for generation: "
                "tokenizer.padding_side = 'left' (or pad on the left yourself)")


def _check_prefill_chunk_size(generation_config) -> None:
    chunk = getattr(generation_config, "prefill_chunk_size", None)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise KimiK3InputError(f"prefill_chunk_size must be a whole number of tokens >= 1 (or None: the prompt in "
                               f"one step), got {chunk!r}")


@contextmanager
def _cache_kept_in_train_mode(model: nn.Module):
    """generate() runs without gradients, where activation checkpointing saves nothing; left on in train mode it
    makes transformers drop the cache in every layer, so each step would recompute the whole sequence."""
    switched = [m for m in model.modules() if model.training and getattr(m, "gradient_checkpointing", False) is True]
    for module in switched:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in switched:
            module.gradient_checkpointing = True


# generate(cache_implementation=...) -> where the hybrid cache keeps its MLA latents between steps
_CACHE_IMPLEMENTATIONS = {None: None, "dynamic": None, "static": None, "offloaded": "cpu", "offloaded_static": "cpu"}


class KimiK3GenerationMixin:
    """Mixed into K3's generating classes (text and multimodal) before transformers' GenerationMixin."""

    # override: generate() has no public hook to refuse inputs before its first step or to claim a given cache
    def generate(self, *args, **kwargs):
        """transformers' generate(), with inputs it cannot continue correctly refused by name
        (`KimiK3InputError`), and the cache kept in train mode with activation checkpointing on."""
        _check_generation_inputs(args, kwargs)
        cache = either_cache(kwargs.get("cache"), kwargs.get("past_key_values"))
        # (a cache given to a running generate() refuses a second concurrent one: both would step one state)
        claimed = cache.generating(self.config.get_text_config()) if isinstance(cache, KimiK3HybridCache) \
            else nullcontext()
        with claimed, _cache_kept_in_train_mode(self):
            return super().generate(*args, **kwargs)

    # override: transformers' documented per-model hook for the step inputs
    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, past_key_values=None, cache=None,
                                      **kwargs):
        """transformers' preparation, with the tokens a given cache already holds dropped from a first step that would
        feed them all: assisted and prompt-lookup decoding leave the first step unsliced (right for an empty cache),
        so continuing a conversation from a returned cache ran the whole history through the model again on top of
        it (a recurrent KDA state absorbs it twice: wrong tokens from the first step).

        The first input of a generate() call given a filled `KimiK3HybridCache` must be the whole sequence and start
        with the tokens the cache holds (`KimiK3HybridCache.plan_generate_step`), else `KimiK3CacheError`: a KDA
        state continued under another prompt gives an answer that differs from a fresh run. A first step fed as
        ``inputs_embeds`` has no ids to compare and is not checked."""
        past_key_values = either_cache(cache, past_key_values)
        if isinstance(past_key_values, KimiK3HybridCache) and input_ids is not None:
            first_iteration = kwargs.get("is_first_iteration")
            next_sequence_length = past_key_values.plan_generate_step(
                input_ids, next_sequence_length, kwargs.get("attention_mask"), first_iteration=first_iteration,
                embedded=kwargs.get("inputs_embeds") is not None and first_iteration)
        kwargs[CACHE_KWARG] = past_key_values
        return super().prepare_inputs_for_generation(input_ids, next_sequence_length=next_sequence_length, **kwargs)


    # override: no public hook checks a generation_config field transformers does not know to refuse
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        """transformers' checks, after a named error for a prefill chunk size K3 cannot honour. (Assisted decoding
        needs no flag here: transformers 5.25 no longer refuses it for stateful models, and `KimiK3HybridCache`
        crops its recorded KDA states.)"""
        _check_prefill_chunk_size(generation_config)
        return super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)


    # override: transformers builds its own cache classes here; no public hook names a model's cache class
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        """generate() builds our hybrid cache (DynamicCache cannot hold KDA state next to an MLA latent). A filled cache
        it is given refuses a chunked prefill (its chunks carry only new tokens, so the held ones could not be
        checked) and has its first input checked against the tokens it holds (`prepare_inputs_for_generation`)."""
        given = model_kwargs.get(CACHE_KWARG)
        if given is not None:
            chunk = generation_config.prefill_chunk_size
            if isinstance(given, KimiK3HybridCache) and chunk is not None and given.get_seq_length() > 0:
                raise KimiK3CacheError(
                    f"generate(prefill_chunk_size={chunk}) cannot continue from a filled cache "
                    f"({given.get_seq_length()} tokens): its chunks carry only the new tokens, so input_ids could not "
                    "be checked against the tokens the cache holds. Pass prefill_chunk_size=None (only the tokens past "
                    "the cache are computed), or feed the new tokens in chunks yourself with model(chunk, "
                    "past_key_values=cache, use_cache=True) first")
            # transformers' own handling of a given cache (marks it the caller's, so generate() returns it intact)
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode,
                                                         batch_size, max_cache_length)
        if generation_config.use_cache is False:
            return
        # transformers' cache_implementation names map onto the hybrid cache: it is always sized for the whole
        # generation, "static" fixes its shapes and addresses (what compiled decode steps and CUDA graphs need; with
        # it generate() compiles the steps where transformers compiles them) and "offloaded" keeps the MLA latents
        # in CPU memory between steps
        implementation = getattr(generation_config, "cache_implementation", None)
        if implementation not in _CACHE_IMPLEMENTATIONS:
            raise ValueError(f"cache_implementation={implementation!r} is not available for K3: its hybrid cache (KDA "
                             f"states + MLA latents) takes {sorted(k for k in _CACHE_IMPLEMENTATIONS if k)} (or none); "
                             "for other layouts build a KimiK3HybridCache and pass it as past_key_values")
        # Latent buffers sized for the whole generation at once (prompt + new tokens): no regrowth copies.
        sized = max_cache_length if max_cache_length and max_cache_length > 0 else None
        static = implementation == "static" and not generation_config.is_assistant
        rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        reserved = sized or (generation_config.max_length if static else None)
        if reserved and _CACHE_IMPLEMENTATIONS[implementation] is None:
            try:  # refused before anything is allocated (or, for the growing cache, reserved)
                check_cache_fits(self.config.get_text_config(), reserved, rows, self.dtype, self.device, static=static,
                                 model=self)
            except KimiK3CacheSizeError:
                if static:
                    raise
                sized = None  # the growing cache then reserves little and grows as tokens come
        cache = KimiK3HybridCache(self.config.get_text_config(), max_cache_len=sized or (
                                      generation_config.max_length if static else None),
                                  offload_latents_to=_CACHE_IMPLEMENTATIONS[implementation], static=static)
        if generation_config.is_assistant:  # an assistant's drafts are rolled back after verification
            cache.activate_past_recording()
        model_kwargs[CACHE_KWARG] = cache



__all__ = ["KimiK3GenerationMixin", "KimiK3InputError", "check_input_ids"]
