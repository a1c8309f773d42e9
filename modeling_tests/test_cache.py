"""`KimiK3HybridCache` (cache.py), the only owner of decoding state.

* Rollback: a forward run with past recording keeps the KDA states of its last tokens, and a crop continues exactly
  like a fresh run on the shorter sequence.
* The cache knows what it holds (issue 27): the token ids it was built from, so that generate() refuses a prompt that
  does not extend them instead of continuing another sequence's recurrent state; the media behind its media slots;
  in a saved file, per-layer lengths and a fingerprint of the weights that made it, all checked by `load`.
* The static cache (`KimiK3HybridCache(static=True)`, ``generate(cache_implementation="static")``): fixed shapes and
  addresses for compiled decode steps. Its steps are checked against a forward over the whole sequence with no cache
  at all (teacher forcing), and against the growing cache's steps.
"""

import copy
import json
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from torch._dynamo.utils import counters
from transformers import CompileConfig

from transformers_k3 import (
    KimiK3CacheError,
    KimiK3Config,
    KimiK3ForCausalLM,
    KimiK3ForConditionalGeneration,
    KimiK3HybridCache,
    KimiK3InputError,
    KimiK3Model,
    KimiK3TextConfig,
    kernelize,
)
from transformers_k3.cache import KimiK3CacheState, KimiK3StaticMLACacheLayer
from transformers_k3.cache_io import KimiK3CacheFileError, _fingerprint_samples, weights_fingerprint
from transformers_k3.ops import cpu_kernel
from transformers_k3.safetensors_header import CheckpointError

from references import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")


def greedy(model, ids, n, **kwargs):
    return model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)


def first_turn(model, ids, n=4, **kwargs):
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                         return_dict_in_generate=True, **kwargs)
    return out.sequences, out.past_key_values


# ---------------------------------------------------------------- reuse of a returned cache
def test_a_cache_reused_for_another_prompt_is_refused_and_a_continuation_equals_a_fresh_run(tiny_model):
    prompt_a = torch.randint(3, 512, (1, 8), generator=torch.Generator().manual_seed(1))
    sequences, cache = first_turn(tiny_model, prompt_a)
    held = cache.get_seq_length()
    assert held == 11 and torch.equal(cache.token_ids, sequences[:, :held])
    prompt_b = torch.randint(3, 512, (1, 20), generator=torch.Generator().manual_seed(2))
    assert not torch.equal(prompt_b[:, :held], sequences[:, :held])
    with pytest.raises(KimiK3CacheError, match=r"built from other tokens.*position 0 of row 0.*pass the whole sequence"):
        greedy(tiny_model, prompt_b, 3, past_key_values=cache)
    # a prompt that differs only at the cache's last position is caught there too
    near = torch.cat([sequences[:, :held - 1], prompt_b], 1)
    with pytest.raises(KimiK3CacheError, match=rf"position {held - 1} of row 0"):
        greedy(tiny_model, near, 3, past_key_values=cache)
    with pytest.raises(KimiK3CacheError, match="pass the whole sequence"):
        greedy(tiny_model, prompt_b[:, :5], 3, past_key_values=cache)  # only new tokens, fewer than the cache holds
    # the refused calls left the cache as it was: the real continuation still equals a fresh run
    history = torch.cat([sequences, prompt_b], 1)
    assert torch.equal(greedy(tiny_model, history, 6, past_key_values=cache), greedy(tiny_model, history, 6))
    assert torch.equal(greedy(tiny_model, history, 6), greedy(tiny_model, history, 6, use_cache=False))


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_a_step_refused_by_the_models_checks_leaves_the_cache_as_it_was(tiny_model, static):
    """The cache records a step's ids before the model checks their values: a refused step (an id outside the
    vocabulary, a mask holding 2) leaves the record, its size and the continuation as without it."""
    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = KimiK3HybridCache(tiny_model.config, max_cache_len=32, static=static)
    with torch.no_grad():
        tiny_model(ids[:, :6], past_key_values=cache, use_cache=True)
        held_bytes = cache.nbytes()
        bad = ids[:, 6:9].clone()
        bad[0, 1] = tiny_model.config.vocab_size
        with pytest.raises(KimiK3InputError, match="outside this model's vocabulary"):
            tiny_model(bad, past_key_values=cache, use_cache=True)
        with pytest.raises(KimiK3InputError, match="only 0 and 1"):
            tiny_model(ids[:, 6:9], attention_mask=torch.full((1, 9), 2), past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 6 and torch.equal(cache.token_ids, ids[:, :6])
        assert cache.nbytes() == held_bytes
        logits = tiny_model(ids[:, 6:], past_key_values=cache, use_cache=True).logits
        fresh = tiny_model(ids).logits[:, 6:]
    torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)
    assert torch.equal(cache.token_ids, ids)


def test_only_the_new_tokens_with_a_full_mask_is_refused(tiny_model):
    """transformers also accepts only the new tokens with an attention mask covering the history; the history is then
    never seen, so cannot be checked (and the first step used to be sliced as if it were the whole sequence)."""
    prompt = torch.randint(3, 512, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    sequences, cache = first_turn(tiny_model, prompt, attention_mask=mask)
    new = torch.randint(3, 512, (2, 15))
    full_mask = torch.cat([mask, torch.ones(2, 4 + 15, dtype=torch.long)], 1)
    with pytest.raises(KimiK3CacheError, match="attention_mask of the same length, got 15 ids and a mask of 25"):
        greedy(tiny_model, new, 2, past_key_values=cache, attention_mask=full_mask)
    # without padding generate() drops the all-ones mask: the new tokens are then taken for the whole sequence
    sequences, cache = first_turn(tiny_model, prompt[:1])
    with pytest.raises(KimiK3CacheError, match="built from other tokens.*pass the whole sequence as input_ids"):
        greedy(tiny_model, new[:1], 2, past_key_values=cache, attention_mask=torch.ones(1, 25, dtype=torch.long))


def test_left_padded_batch_record_and_continuation(tiny_model):
    """Batch 2 with left padding: the record holds the ids and -1 where the mask masks; a continuation with the
    padded history (any pad id, the same mask) equals a fresh run, one that drops the mask is refused there."""
    rows = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 5)]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 9 - len(r):], mask[i, 9 - len(r):] = r, 1
    sequences, cache = first_turn(tiny_model, ids, attention_mask=mask)
    held = cache.get_seq_length()
    recorded = cache.token_ids
    assert recorded.shape == (2, held) and torch.equal(recorded[:, 9:], sequences[:, 9:held])
    assert torch.equal(recorded[:, :9], ids.masked_fill(mask == 0, -1))
    new = torch.randint(3, 512, (2, 4))
    history = torch.cat([sequences, new], 1)
    full_mask = torch.cat([mask, torch.ones(2, history.shape[1] - 9, dtype=torch.long)], 1)
    want = greedy(tiny_model, history, 5, attention_mask=full_mask)
    other_pad = history.masked_fill(full_mask == 0, 7)
    assert torch.equal(greedy(tiny_model, other_pad, 5, attention_mask=full_mask,
                              past_key_values=copy.deepcopy(cache))[:, -5:], want[:, -5:])
    with pytest.raises(KimiK3CacheError, match=r"position 0 of row 1 the cache holds padding \(attention_mask 0\)"):
        greedy(tiny_model, history, 5, attention_mask=torch.ones_like(full_mask), past_key_values=cache)
    assert torch.equal(greedy(tiny_model, history, 5, attention_mask=full_mask, past_key_values=cache), want)


def test_another_batch_is_refused_and_beam_search_continues_after_repeating_the_rows(tiny_model):
    prompt = torch.randint(3, 512, (1, 7))
    sequences, cache = first_turn(tiny_model, prompt)
    history = torch.cat([sequences, torch.randint(3, 512, (1, 3))], 1)
    with pytest.raises(KimiK3CacheError, match=r"holds 1 sequence\(s\) but input_ids has 2 rows"):
        greedy(tiny_model, history.repeat(2, 1), 2, past_key_values=copy.deepcopy(cache))
    with pytest.raises(KimiK3CacheError, match="batch_repeat_interleave"):
        greedy(tiny_model, history, 4, num_beams=3, past_key_values=copy.deepcopy(cache))
    with torch.no_grad(), pytest.raises(KimiK3CacheError, match="holds 1 sequence.*input has 3 rows"):
        tiny_model(torch.randint(3, 512, (3, 2)), past_key_values=copy.deepcopy(cache), use_cache=True)
    # beam search from the filled cache (its rows repeated, then reordered every step) = beam search from scratch
    cache.batch_repeat_interleave(3)
    assert torch.equal(greedy(tiny_model, history, 4, num_beams=3, past_key_values=cache),
                       greedy(tiny_model, history, 4, num_beams=3))


def test_reorder_select_and_repeat_move_the_record_with_the_rows(tiny_model):
    ids = torch.randint(3, 512, (3, 6))
    cache = KimiK3HybridCache(tiny_model.config)
    with torch.no_grad():
        tiny_model(ids, past_key_values=cache, use_cache=True)
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    assert torch.equal(cache.token_ids, ids[[2, 0, 0]])
    cache.batch_select_indices(torch.tensor([0, 1]))
    assert torch.equal(cache.token_ids, ids[[2, 0]])
    cache.batch_repeat_interleave(2)
    assert torch.equal(cache.token_ids, ids[[2, 2, 0, 0]])
    cache.reset()
    assert cache.token_ids is None and cache.get_seq_length() == 0


@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant"])
def test_rollback_crops_the_record_too(tiny_model, mode):
    """Assisted and prompt-lookup decoding crop the cache after rejected drafts: the record is cropped with it, so
    the returned cache holds exactly the ids generate() returned (but the last) and continues like a fresh run."""
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    extra = dict(prompt_lookup_num_tokens=4) if mode == "prompt_lookup" else dict(assistant_model=copy.deepcopy(
        randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval(), seed=5)))
    sequences, cache = first_turn(tiny_model, prompt, n=16, **extra)
    assert torch.equal(sequences, greedy(tiny_model, prompt, 16))
    held = cache.get_seq_length()
    assert held == sequences.shape[1] - 1 and torch.equal(cache.token_ids, sequences[:, :held])
    history = torch.cat([sequences, torch.tensor([[5, 6, 7]])], 1)
    assert torch.equal(greedy(tiny_model, history, 8, past_key_values=cache, **extra), greedy(tiny_model, history, 8))
    with torch.no_grad():
        cache = KimiK3HybridCache(tiny_model.config)
        tiny_model(prompt[:, :8], past_key_values=cache, use_cache=True)
        cache.activate_past_recording()
        tiny_model(prompt[:, 8:], past_key_values=cache, use_cache=True)
        cache.crop(-3)
    assert torch.equal(cache.token_ids, prompt[:, :10])


def test_chunked_prefill_cannot_continue_a_filled_cache(tiny_model):
    sequences, cache = first_turn(tiny_model, torch.randint(3, 512, (1, 6)))
    history = torch.cat([sequences, torch.randint(3, 512, (1, 30))], 1)
    with pytest.raises(KimiK3CacheError, match="prefill_chunk_size=None"):
        greedy(tiny_model, history, 2, past_key_values=cache, prefill_chunk_size=8)
    # what the message offers: the new tokens in chunks by hand, then generate() on the whole sequence
    with torch.no_grad():
        for start in range(sequences.shape[1] - 1, history.shape[1] - 1, 8):
            tiny_model(history[:, start:min(start + 8, history.shape[1] - 1)], past_key_values=cache, use_cache=True)
    assert torch.equal(greedy(tiny_model, history, 4, past_key_values=cache), greedy(tiny_model, history, 4))


def test_inputs_embeds_positions_are_recorded_as_unknown(tiny_model):
    ids = torch.randint(3, 512, (1, 5))
    cache = KimiK3HybridCache(tiny_model.config)
    with torch.no_grad():
        tiny_model(inputs_embeds=tiny_model.get_input_embeddings()(ids), past_key_values=cache, use_cache=True)
        tiny_model(ids[:, :2], past_key_values=cache, use_cache=True)
    assert cache.token_ids.tolist() == [[-2] * 5 + ids[0, :2].tolist()]
    # the unknown positions cannot be checked, the known ones are
    history = torch.cat([ids, ids[:, :2], torch.randint(3, 512, (1, 2))], 1)
    assert greedy(tiny_model, history, 2, past_key_values=copy.deepcopy(cache)).shape == (1, 11)
    wrong = history.clone()
    wrong[0, 6] = (wrong[0, 6] + 1) % 512
    with pytest.raises(KimiK3CacheError, match="position 6 of row 0"):
        greedy(tiny_model, wrong, 2, past_key_values=cache)


def test_the_multimodal_model_records_the_ids_behind_its_embeddings():
    from transformers_k3 import KimiK3Config, KimiK3ForConditionalGeneration

    torch.manual_seed(0)
    model = randomize_(KimiK3ForConditionalGeneration(KimiK3Config.tiny()).eval(), std=0.1)
    pad = model.config.media_placeholder_token_id
    vision = model.config.vision_config
    grid = torch.tensor([[1, 4, 4]])  # one 4x4-patch image: 4 tokens after the 2x2 merge
    pixels = torch.randn(16, 3, vision.patch_size, vision.patch_size, generator=torch.Generator().manual_seed(0))
    ids = torch.cat([torch.tensor([[5, 6]]), torch.full((1, 4), pad), torch.tensor([[7, 8, 9]])], 1)
    media = dict(pixel_values=pixels, image_grid_thw=grid)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0,
                         return_dict_in_generate=True, **media)
    cache, held = out.past_key_values, out.past_key_values.get_seq_length()
    assert torch.equal(cache.token_ids, out.sequences[:, :held])
    history = torch.cat([out.sequences, torch.tensor([[10, 11]])], 1)
    fresh = model.generate(history, max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0, **media)
    with pytest.raises(KimiK3CacheError, match="built from other tokens"):
        model.generate(history[:, 1:], past_key_values=cache, max_new_tokens=3, do_sample=False, eos_token_id=None,
                       pad_token_id=0)
    assert torch.equal(model.generate(history, past_key_values=cache, max_new_tokens=3, do_sample=False,
                                      eos_token_id=None, pad_token_id=0), fresh)


# ---------------------------------------------------------------- the weights fingerprint
def test_weights_fingerprint_follows_the_weights_not_their_placement(tiny_model, tmp_path):
    base = weights_fingerprint(tiny_model)
    assert base == weights_fingerprint(tiny_model.model)  # any head around the same decoder
    other = randomize_(KimiK3ForCausalLM(tiny_model.config).eval(), seed=1)
    assert weights_fingerprint(other) != base
    tiny_model.save_pretrained(tmp_path)
    assert weights_fingerprint(KimiK3ForCausalLM.from_pretrained(tmp_path)) == base
    # a sampled element of one layer's norm changes it; the LM head (states do not depend on it) does not
    tweaked = copy.deepcopy(tiny_model)
    with torch.no_grad():
        tweaked.model.layers[3].post_attention_layernorm.weight[0] += 1e-3
    assert weights_fingerprint(tweaked) != base
    tweaked = copy.deepcopy(tiny_model)
    with torch.no_grad():
        tweaked.lm_head.weight.add_(1.0)
    assert weights_fingerprint(tweaked) == base
    # bf16 weights: the same whether the model holds them in bf16 or in fp32
    half = copy.deepcopy(tiny_model).to(torch.bfloat16)
    assert weights_fingerprint(half) == weights_fingerprint(copy.deepcopy(half).float()) != base
    with torch.device("meta"):
        assert weights_fingerprint(KimiK3ForCausalLM(tiny_model.config)) is None


def test_weights_fingerprint_reads_a_small_sample_at_full_size():
    """At the release's size (meta device: nothing allocated) the fingerprint samples about 1.3M values of the
    2.8T: a few per matrix, every vector (norms) strided."""
    with torch.device("meta"):
        model = KimiK3Model(KimiK3TextConfig())
    sampled = sum(t.numel() for _, t in _fingerprint_samples(model))
    total = sum(p.numel() for p in model.parameters())
    assert total > 1e12 and sampled < 2e6, (sampled, total)


# ---------------------------------------------------------------- save / load
@pytest.fixture
def saved(tiny_model, tmp_path):
    """A cache after generate(8-token prompt, 4 new tokens) (11 tokens held), saved; (path, sequences, cache)."""
    prompt = torch.randint(3, 512, (2, 8), generator=torch.Generator().manual_seed(3))
    sequences, cache = first_turn(tiny_model, prompt)
    path = tmp_path / "session.safetensors"
    cache.save(path)
    return path, sequences, cache


def rewrite(path, change_tensors=None, change_metadata=None):
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    if change_tensors:
        change_tensors(tensors)
    if change_metadata:
        change_metadata(metadata)
    save_file(tensors, str(path), metadata=metadata)


def test_round_trip_continues_exactly_like_the_uninterrupted_run(tiny_model, saved):
    path, sequences, _ = saved
    assert not list(path.parent.glob(".tmp-*"))
    restored = KimiK3HybridCache.load(path, tiny_model.config, model=tiny_model)
    assert restored.get_seq_length() == 11 and torch.equal(restored.token_ids, sequences[:, :11])
    assert torch.equal(greedy(tiny_model, sequences, 4, past_key_values=restored), greedy(tiny_model, sequences[:, :8], 8))
    # the loaded cache still knows its tokens
    with pytest.raises(KimiK3CacheError, match="built from other tokens"):
        greedy(tiny_model, torch.cat([sequences.flip(1), sequences], 1), 2, past_key_values=restored)
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    assert json.loads(metadata["lengths"]) == [11] * tiny_model.config.num_hidden_layers
    assert metadata["weights_fingerprint"] == weights_fingerprint(tiny_model)


def test_load_refuses_latents_cut_to_fewer_rows(tiny_model, saved):
    path = saved[0]
    rewrite(path, lambda t: t.update({"layers.2.latent": t["layers.2.latent"][:, :3].contiguous()}))
    with pytest.raises(KimiK3CacheError, match=r"`layers.2.latent` has shape \[2, 3, 40\].*\[2, 11, 40\]"):
        KimiK3HybridCache.load(path, tiny_model.config)


def test_load_refuses_a_missing_latent(tiny_model, saved):
    path = saved[0]
    rewrite(path, lambda t: t.pop("layers.5.latent"))
    with pytest.raises(KimiK3CacheError, match=r"\['layers.5.latent'\] are missing"):
        KimiK3HybridCache.load(path, tiny_model.config)


def test_load_refuses_a_wrong_seq_length(tiny_model, saved):
    path = saved[0]
    rewrite(path, change_metadata=lambda m: m.update(seq_length="12"))
    with pytest.raises(KimiK3CacheError, match="holds 12 tokens but layers"):
        KimiK3HybridCache.load(path, tiny_model.config)
    # the lengths agreeing with a wrong count: the tensors do not
    rewrite(path, change_metadata=lambda m: m.update(lengths=json.dumps([12] * 6)))
    with pytest.raises(KimiK3CacheError, match=r"`tokens` has shape \[2, 11\].*\[2, 12\]"):
        KimiK3HybridCache.load(path, tiny_model.config)
    rewrite(path, change_metadata=lambda m: m.update(seq_length="eleven"))
    with pytest.raises(KimiK3CacheError, match="`seq_length` metadata is 'eleven'"):
        KimiK3HybridCache.load(path, tiny_model.config)


def test_load_refuses_a_cache_made_by_other_weights(tiny_model, saved):
    path = saved[0]
    other = randomize_(KimiK3ForCausalLM(tiny_model.config).eval(), seed=1)
    with pytest.raises(KimiK3CacheError, match="made by a model with other weights"):
        KimiK3HybridCache.load(path, tiny_model.config, model=other)
    with pytest.raises(KimiK3CacheError, match="other weights"):
        KimiK3HybridCache.load(path, tiny_model.config, fingerprint=weights_fingerprint(other))
    KimiK3HybridCache.load(path, tiny_model.config, model=tiny_model)  # its own model: accepted
    # a cache filled by plain forwards and saved without model= carries the fingerprint of the model that wrote it
    cache = KimiK3HybridCache(tiny_model.config)
    with torch.no_grad():
        tiny_model(torch.randint(3, 512, (1, 5)), past_key_values=cache, use_cache=True)
    cache.save(path)
    with pytest.raises(KimiK3CacheError, match="other weights"):
        KimiK3HybridCache.load(path, tiny_model.config, model=other)


def test_load_without_a_checkable_fingerprint_warns(tiny_model, saved):
    path = saved[0]
    with torch.device("meta"):
        unreadable = KimiK3ForCausalLM(tiny_model.config)
    with pytest.warns(UserWarning, match="cannot be read cheaply"):
        KimiK3HybridCache.load(path, tiny_model.config, model=unreadable)
    # a file without a fingerprint (here also without the digest that covers it) is refused unless trusted
    rewrite(path, change_metadata=lambda m: [m.update(weights_fingerprint="", version="2"), m.pop("content_digest")])
    with pytest.raises(KimiK3CacheError, match="saved without a weights fingerprint.*trust_unverified=True"):
        KimiK3HybridCache.load(path, tiny_model.config, model=tiny_model)
    with pytest.warns(UserWarning, match="saved without a weights fingerprint"):
        KimiK3HybridCache.load(path, tiny_model.config, model=tiny_model, trust_unverified=True)
    rewrite(path, change_metadata=lambda m: m.update(weights_fingerprint="not-a-digest"))
    with pytest.raises(KimiK3CacheError, match="not a SHA-256 hex digest"):
        KimiK3HybridCache.load(path, tiny_model.config, model=tiny_model)


def test_load_wraps_a_truncated_file(tiny_model, saved):
    path = saved[0]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(KimiK3CacheError, match="truncated") as error:
        KimiK3HybridCache.load(path, tiny_model.config)
    assert isinstance(error.value, CheckpointError) and isinstance(error.value, KimiK3CacheFileError)
    path.write_bytes(data[:5])
    with pytest.raises(KimiK3CacheError, match="not a safetensors file"):
        KimiK3HybridCache.load(path, tiny_model.config)


def test_load_wraps_random_bytes(tiny_model, tmp_path):
    path = tmp_path / "noise.safetensors"
    path.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
                     .numpy().tobytes())
    with pytest.raises(KimiK3CacheError, match="noise.safetensors"):
        KimiK3HybridCache.load(path, tiny_model.config)


@pytest.mark.parametrize("name, dtype, rule", [("layers.0.recurrent_state", torch.float16, "float32"),
                                               ("layers.2.latent", torch.int32, "a floating-point dtype"),
                                               ("layers.1.conv_state", torch.int64, "a floating-point dtype"),
                                               ("tokens", torch.float32, "int64")])
def test_load_refuses_a_wrong_dtype(tiny_model, saved, name, dtype, rule):
    path = saved[0]
    rewrite(path, lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(KimiK3CacheError, match=rf"`{name}` is {dtype}, a saved cache stores it as {rule}"):
        KimiK3HybridCache.load(path, tiny_model.config)


def test_load_refuses_missing_or_garbled_metadata_and_foreign_entries(tiny_model, saved):
    path = saved[0]
    good = path.read_bytes()
    cases = [
        (dict(change_metadata=lambda m: m.pop("lengths")), "`lengths` metadata is missing"),
        (dict(change_metadata=lambda m: m.update(lengths="[11, 11")), "`lengths` metadata is missing or not JSON"),
        (dict(change_metadata=lambda m: m.update(lengths="[11, 11]")), "one token count per layer"),
        (dict(change_metadata=lambda m: m.update(config="{")), "`config` metadata is missing or not a JSON object"),
        (dict(change_metadata=lambda m: m.update(format="other")), "metadata format is 'other'"),
        (dict(change_metadata=lambda m: m.update(version="9")), "format version '9'"),
        (dict(change_metadata=lambda m: m.pop("batch_size")), "`batch_size` metadata is None"),
        (dict(change_tensors=lambda t: t.update(extra=torch.zeros(1))), r"tensors no K3 cache of this config has: \['extra'\]"),
        (dict(change_tensors=lambda t: t["tokens"].__setitem__((0, 0), 512)), "outside this model's vocabulary"),
    ]
    for change, message in cases:
        path.write_bytes(good)
        rewrite(path, **change)
        with pytest.raises(KimiK3CacheError, match=message):
            KimiK3HybridCache.load(path, tiny_model.config)
    path.write_bytes(good)
    with pytest.raises(KimiK3CacheError, match="kv_lora_rank"):
        KimiK3HybridCache.load(path, KimiK3TextConfig.tiny(kv_lora_rank=16))


def test_a_file_of_the_first_format_loads_with_its_tokens_unknown(tiny_model, saved):
    path, sequences, _ = saved
    rewrite(path, lambda t: t.pop("tokens"), lambda m: [m.pop(k) for k in ("lengths", "batch_size", "content_digest",
                                                                           "weights_fingerprint")] + [m.update(version="1")])
    with pytest.raises(KimiK3CacheError, match="without the token ids.*trust_unverified=True"):
        KimiK3HybridCache.load(path, tiny_model.config)
    with pytest.warns(UserWarning, match="without the token ids"):
        restored = KimiK3HybridCache.load(path, tiny_model.config, trust_unverified=True)
    assert torch.equal(restored.token_ids, torch.full((2, 11), -2))
    assert torch.equal(greedy(tiny_model, sequences, 4, past_key_values=restored), greedy(tiny_model, sequences[:, :8], 8))


def test_an_empty_cache_round_trips(tiny_model, tmp_path):
    KimiK3HybridCache(tiny_model.config).save(tmp_path / "empty.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = KimiK3HybridCache.load(tmp_path / "empty.safetensors", tiny_model.config)
    assert restored.get_seq_length() == 0 and restored.token_ids is None
    ids = torch.randint(3, 512, (1, 6))
    assert torch.equal(greedy(tiny_model, ids, 3, past_key_values=restored), greedy(tiny_model, ids, 3))


# ---------------------------------------------------------------- the state as a whole (training in segments)
def test_a_state_taken_and_started_from_continues_like_the_cache_it_came_from(tiny_model):
    """`state(detached=True)` survives the next forward (copies), a fresh cache `start_from` it gives the same next
    logits as the cache it came from, and `detach_` keeps the values while cutting the training forward's graph."""
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    cache = KimiK3HybridCache(tiny_model.config)
    with torch.no_grad():
        tiny_model(ids[:, :9], past_key_values=cache, use_cache=True)
        state = cache.state(detached=True)
        kinds = tiny_model.config.layer_types
        assert sorted(state.kda) == [i for i, kind in enumerate(kinds) if kind == "linear_attention"]
        assert sorted(state.latents) == [i for i, kind in enumerate(kinds) if kind != "linear_attention"]
        assert all(latent.shape[1] == 9 for latent in state.latents.values())
        kda_before = {i: tuple(x.clone() for x in pair) for i, pair in state.kda.items()}
        want = tiny_model(ids[:, 9:], past_key_values=cache, use_cache=True).logits
        for i, pair in state.kda.items():  # (the copies did not follow the cache's in-place decode steps)
            for got, kept in zip(pair, kda_before[i]):
                assert torch.equal(got, kept)
        restored = KimiK3HybridCache(tiny_model.config)
        restored.start_from(state)
        assert restored.get_seq_length() == 9
        torch.testing.assert_close(tiny_model(ids[:, 9:], past_key_values=restored, use_cache=True).logits, want,
                                   rtol=0, atol=0)
    trained = KimiK3HybridCache(tiny_model.config)
    tiny_model(ids[:, :9], past_key_values=trained, use_cache=True)
    live = trained.state()
    assert all(x.requires_grad for pair in live.kda.values() for x in pair)
    values = {i: tuple(x.detach().clone() for x in pair) for i, pair in live.kda.items()}
    assert trained.detach_() is trained
    after = trained.state()
    assert not any(x.requires_grad for pair in after.kda.values() for x in pair)
    assert not any(latent.requires_grad for latent in after.latents.values())
    for i, pair in after.kda.items():
        assert all(torch.equal(a, b) for a, b in zip(pair, values[i]))


def test_latents_that_require_grad_are_held_as_given(tiny_model):
    """`start_from` holds MLA latents that require grad as the tensors given, not a copy (exact segment training):
    the next step's logits and the leaves' gradients are those of a cache that copied them into its buffer, the
    step's latents come back as computed (`state(latents_from=)`), and a decode step after joins them into a buffer
    of the cache's own, with the logits of the copying cache and the leaves unwritten."""
    ids = torch.randint(3, 512, (2, 14), generator=torch.Generator().manual_seed(4))
    filled = KimiK3HybridCache(tiny_model.config)
    with torch.no_grad():
        tiny_model(ids[:, :9], past_key_values=filled, use_cache=True)
    state = filled.state(detached=True)
    caches, leaves = [], []
    for as_given in (True, False):
        latents = {i: latent.clone().requires_grad_() for i, latent in state.latents.items()}
        cache = KimiK3HybridCache(tiny_model.config)
        cache.start_from(KimiK3CacheState(state.kda, latents if as_given else {}))
        for i, latent in latents.items():
            if as_given:
                assert cache.layers[i].held_latents().data_ptr() == latent.data_ptr()
            else:  # (the buffer the cache holds a state in: a copy, in the leaves' graph)
                cache.layers[i].update(latent)
                assert cache.layers[i].held_latents().data_ptr() != latent.data_ptr()
        caches.append(cache)
        leaves.append(latents)
    logits = [tiny_model(ids[:, 9:13], past_key_values=cache, use_cache=True).logits for cache in caches]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    steps = caches[0].state(latents_from=9).latents
    assert sorted(steps) == sorted(state.latents) and all(t.shape[1] == 4 and t.requires_grad for t in steps.values())
    torch.testing.assert_close(steps, caches[1].state(latents_from=9).latents, rtol=0, atol=0)
    for out in logits:
        out.square().sum().backward()
    for i in state.latents:
        assert leaves[0][i].grad.abs().sum() > 0
        torch.testing.assert_close(leaves[0][i].grad, leaves[1][i].grad, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        decoded = [tiny_model(ids[:, 13:], past_key_values=cache, use_cache=True).logits for cache in caches]
    torch.testing.assert_close(decoded[0], decoded[1], rtol=0, atol=0)
    for i, latent in state.latents.items():
        assert caches[0].layers[i].parts is None and caches[0].get_seq_length() == 14
        assert torch.equal(leaves[0][i], latent)


# ---------------------------------------------------------------- rollback (the cache owns the KDA history)
@pytest.mark.parametrize("recorded_length", [5, 20])
def test_crop_after_recorded_forwards_continues_like_a_fresh_run(tiny_model, recorded_length):
    """With past recording on, forwards of 5 tokens (all recorded) or 20 (more than the cache's rollback window of
    16: only the last 16 recorded) then a crop of 3 leave every KDA state and conv window, and the logits of the next
    tokens, those of a fresh run over the sequence without the cropped tokens."""
    ids = torch.randint(3, 400, (2, 8 + recorded_length + 4), generator=torch.Generator().manual_seed(3))
    kept = 8 + recorded_length - 3
    with torch.no_grad():
        cache = KimiK3HybridCache(tiny_model.config, max_rollback=16)
        tiny_model(ids[:, :8], past_key_values=cache, use_cache=True)
        cache.activate_past_recording()
        tiny_model(ids[:, 8:8 + recorded_length], past_key_values=cache, use_cache=True)
        cache.crop(-3)
        fresh = KimiK3HybridCache(tiny_model.config)
        tiny_model(ids[:, :kept], past_key_values=fresh, use_cache=True)
        for mine, theirs in zip(cache.layers, fresh.layers):
            if hasattr(mine, "recurrent_state"):
                torch.testing.assert_close(mine.recurrent_state, theirs.recurrent_state, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(mine.conv_state, theirs.conv_state, atol=1e-5, rtol=1e-5)
        tail = ids[:, kept:kept + 4]
        got = tiny_model(tail, past_key_values=cache, use_cache=True).logits
        want = tiny_model(tail, past_key_values=fresh, use_cache=True).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_a_crop_beyond_the_recorded_window_is_refused(tiny_model):
    ids = torch.randint(3, 400, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = KimiK3HybridCache(tiny_model.config, max_rollback=4)
        tiny_model(ids[:, :4], past_key_values=cache, use_cache=True)
        cache.activate_past_recording()
        tiny_model(ids[:, 4:], past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="only 4 were recorded"):
        cache.crop(-5)


def test_media_items_are_declared_and_reset():
    """The multimodal model's record of the media behind the held media slots is the cache's own attribute; media
    given again for the held slots must be the ones it was built from."""
    cache = KimiK3HybridCache(KimiK3TextConfig.tiny())
    assert cache.media_items is None
    cache.update_media([("image", "b", 4)], held=10)
    assert cache.media_items is None  # (unknown stays unknown)
    cache.update_media([("image", "b", 4), ("image", "a", 0)], held=0)
    assert cache.media_items == [("image", "a", 0), ("image", "b", 4)]
    cache.update_media([("video", "c", 9)], held=5)
    assert cache.media_items == [("image", "a", 0), ("image", "b", 4), ("video", "c", 9)]
    with pytest.raises(KimiK3CacheError, match="other images or videos"):
        cache.update_media([("image", "other pixels", 0)], held=5)
    assert cache.media_items == [("image", "a", 0), ("image", "b", 4), ("video", "c", 9)]
    cache.reset()
    assert cache.media_items is None


# ---------------------------------------------------------------- the static cache

@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval())


def padded_prompt():
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding
    return ids, mask


def teacher_forced_logits(model, sequences, mask, prompt_len):
    """The logits at every generated position from one forward over the whole sequence, no cache."""
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], sequences.shape[1] - mask.shape[1])], dim=1)
    with torch.no_grad():
        logits = model(sequences, attention_mask=full_mask, use_cache=False).logits
    return logits[:, prompt_len - 1:-1].float()


def buffers(cache):
    """Addresses of every tensor a decode step reads and writes."""
    out = []
    for layer in cache.layers:
        if isinstance(layer, KimiK3StaticMLACacheLayer):
            out += [layer.latent.data_ptr(), layer.position.data_ptr()]
        else:
            out += [layer.conv_state.data_ptr(), layer.recurrent_state.data_ptr()]
    return out


def test_static_steps_equal_a_forward_without_cache_and_keep_their_buffers(model):
    """Eager steps of one, three (the absorbed multi-token path) and twenty tokens (the expanded path after a cache)
    through a static cache give the logits of a forward over the whole sequence without a cache; the latents, their
    positions and the KDA states keep their addresses from step to step; lengths and token ids are kept."""
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        cache = KimiK3HybridCache(model.config, max_cache_len=48, static=True)
        assert cache.is_compileable and not KimiK3HybridCache(model.config).is_compileable
        got, start, addresses = [], 0, None
        for size in (10, 1, 1, 3, 1, 20, 1, 1, 1, 1):
            got.append(model(ids[:, start:start + size], past_key_values=cache, use_cache=True).logits)
            start += size
            if start > 10:
                addresses = addresses or buffers(cache)
                assert buffers(cache) == addresses
            assert cache.get_seq_length() == start
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=2e-5, rtol=1e-4)
    assert torch.equal(cache.token_ids, ids)
    assert all(layer.latent.shape[1] == 48 for layer in cache.layers if isinstance(layer, KimiK3StaticMLACacheLayer))


def test_static_cache_refuses_what_it_cannot_hold(model):
    with pytest.raises(ValueError, match="needs `max_cache_len`"):
        KimiK3HybridCache(model.config, static=True)
    with pytest.raises(ValueError, match="offload_latents_to=None or static=False"):
        KimiK3HybridCache(model.config, max_cache_len=8, static=True, offload_latents_to="cpu")
    reserved = KimiK3HybridCache(model.config, max_cache_len=8, batch_size=3, static=True)
    with pytest.raises(ValueError, match="preallocated for batch 3"), torch.no_grad():
        model(torch.randint(3, 512, (2, 4)), past_key_values=reserved, use_cache=True)
    cache = KimiK3HybridCache(model.config, max_cache_len=8, static=True)
    ids = torch.randint(3, 512, (1, 9))
    with torch.no_grad():
        model(ids[:, :6], past_key_values=cache, use_cache=True)
        with pytest.raises(KimiK3CacheError, match="holds 8 tokens per MLA layer: 6 are used and 3 more do not fit"):
            model(ids[:, 6:], past_key_values=cache, use_cache=True)


def test_static_cache_reset_keeps_its_buffers_and_saves_like_the_growing_one(model, tmp_path):
    ids = torch.randint(3, 512, (2, 9))
    with torch.no_grad():
        grown = KimiK3HybridCache(model.config)
        model(ids, past_key_values=grown, use_cache=True)
        static = KimiK3HybridCache(model.config, max_cache_len=16, static=True)
        model(ids[:, :4], past_key_values=static, use_cache=True)
        latent = static.layers[2].latent.data_ptr()
        static.reset()
        assert static.get_seq_length() == 0 and not static.holds_tokens()
        model(ids, past_key_values=static, use_cache=True)
        assert static.layers[2].latent.data_ptr() == latent
        static.save(tmp_path / "static.safetensors")
        grown.save(tmp_path / "grown.safetensors")
        loaded = KimiK3HybridCache.load(tmp_path / "static.safetensors", model.config, max_cache_len=16, static=True)
        assert loaded.static and loaded.get_seq_length() == 9 and torch.equal(loaded.token_ids, ids)
        step = torch.randint(3, 512, (2, 1))
        want = model(step, past_key_values=KimiK3HybridCache.load(tmp_path / "grown.safetensors", model.config),
                     use_cache=True).logits
        got = model(step, past_key_values=loaded, use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_generate_compiles_the_decode_steps_of_a_static_cache(model, dtype):
    """generate(cache_implementation="static", compile_config=...) runs its decode steps through one compiled graph
    (fullgraph: a break raises) with the fused CPU kernels inside, on a left-padded batch: the tokens are the greedy
    tokens of a forward over the whole sequence without a cache, and those of eager generate() with either cache.
    Every input of the graph is a tensor (no Python int that changes per step: what CUDA graphs need), the same
    graph serves every step (no recompilation) and the buffers it writes keep their addresses."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    model = kernelize(model.to(dtype))  # (the fused CPU kernels attached, as the README says)
    ids, mask = padded_prompt()
    in_graph, placeholders = set(), []

    def record(gm, example_inputs):
        placeholders.append([type(x).__name__ for x in example_inputs])
        for node in gm.graph.nodes:
            if node.op == "call_function":
                target = node.args[0] if "auto_functionalized" in str(node.target) else node.target
                if str(target).startswith("transformers_k3."):
                    in_graph.add(str(target).split(".")[1])
        return make_boxed_func(gm.forward)

    compile_config = CompileConfig(backend=aot_autograd(fw_compiler=record), fullgraph=True)
    compile_config._compile_all_devices = True  # (transformers compiles on accelerators only unless asked)
    prefilled = {}  # each MLA layer's buffer address after the (eager) prefill

    def watch(module, args, output):
        if not torch.compiler.is_compiling() and not prefilled:
            prefilled.update({id(layer): layer.latent.data_ptr() for layer in output.past_key_values.layers
                              if isinstance(layer, KimiK3StaticMLACacheLayer)})

    handle = None
    try:
        with torch.no_grad():
            eager = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
            eager_static = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                          cache_implementation="static")
            torch._dynamo.reset()
            counters.clear()
            handle = model.register_forward_hook(watch)  # (after kernelize: attached kernels stay attached)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                 cache_implementation="static", compile_config=compile_config,
                                 return_dict_in_generate=True)
    finally:
        if handle is not None:
            handle.remove()
        kernelize(model, False).to(torch.float32)
    compiled = out.sequences
    assert torch.equal(compiled, eager) and torch.equal(eager_static, eager)
    if dtype is torch.float32:  # (in bf16 a cached step and a whole-sequence forward round differently)
        reference = teacher_forced_logits(model, compiled, mask, ids.shape[1])
        assert torch.equal(compiled[:, ids.shape[1]:], reference.argmax(-1))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert len(placeholders) == 1 and set(placeholders[0]) <= {"FakeTensor", "Tensor", "Parameter"}, placeholders
    cache = out.past_key_values
    assert cache.static and cache.get_seq_length() == compiled.shape[1] - 1  # (read back after compiled steps)
    assert torch.equal(cache.token_ids[1, 3:], compiled[1, 3:-1]) and (cache.token_ids[1, :3] == -1).all()
    latents = [layer for layer in cache.layers if isinstance(layer, KimiK3StaticMLACacheLayer)]
    assert {id(layer): layer.latent.data_ptr() for layer in latents} == prefilled
    print("kernels in the decode graph:", sorted(in_graph))
    if cpu_kernel.library() is not None:
        assert {"moe_decode"} <= in_graph, in_graph
    torch._dynamo.reset()


def test_multimodal_generate_takes_the_static_cache():
    torch.manual_seed(0)
    vl = randomize_(KimiK3ForConditionalGeneration(KimiK3Config.tiny()).eval())
    ids = torch.randint(3, 400, (1, 10))
    with torch.no_grad():
        want = vl.generate(ids, max_new_tokens=6, do_sample=False)
        got = vl.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want)


@pytest.mark.parametrize("decode_attn", ["sdpa", "eager", "flash_attention_2"])
def test_static_cache_under_each_attention_implementations_mask(model, decode_attn):
    """A left-padded batch prefilled with SDPA and continued by steps of one and two tokens with another
    implementation's mask (flash attention's is the 2-D padding mask; the absorbed path never calls flash-attn, so
    it runs here): the static cache gives the growing cache's logits and those of one forward without a cache."""
    ids = torch.randint(3, 512, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    results, installed = {}, model.config._attn_implementation
    try:
        with torch.no_grad():
            for static in (False, True):
                model.config._attn_implementation = "sdpa"
                cache = KimiK3HybridCache(model.config, max_cache_len=20, static=static)
                outs = [model(ids[:, :10], attention_mask=mask[:, :10], past_key_values=cache, use_cache=True).logits]
                model.config._attn_implementation = decode_attn
                for start, size in ((10, 1), (11, 2), (13, 1)):
                    outs.append(model(ids[:, start:start + size], attention_mask=mask[:, :start + size],
                                      past_key_values=cache, use_cache=True).logits)
                results[static] = torch.cat(outs, 1)
            model.config._attn_implementation = "sdpa"
            reference = model(ids, attention_mask=mask, use_cache=False).logits
    finally:
        model.config._attn_implementation = installed
    torch.testing.assert_close(results[True], results[False], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[True][:, 10:], reference[:, 10:], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_compiled_generate_with_an_adapter_on_the_latent_projection(attn):
    """A LoRA adapter on ``kv_b_proj`` (or a quantized one) keeps MLA off the absorbed path, which reads the layer's
    weight: the expanded path then reads no length in a compiled step (every row of the static latent, those past
    its tokens masked). generate() compiles the decode steps into one graph with no break and gives eager's tokens,
    on a left-padded batch, with SDPA's boolean mask and the eager implementation's additive one."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = KimiK3TextConfig.tiny()
    config._attn_implementation = attn
    base = randomize_(KimiK3ForCausalLM(config).eval())
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["kv_b_proj"], init_lora_weights=False))
    model.eval()
    ids, mask = padded_prompt()
    compile_config = CompileConfig(backend="aot_eager", fullgraph=True)
    compile_config._compile_all_devices = True
    with torch.no_grad():
        eager = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        torch._dynamo.reset()
        counters.clear()
        compiled = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                  cache_implementation="static", compile_config=compile_config)
        reference = teacher_forced_logits(model, compiled, mask, ids.shape[1])
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled[:, ids.shape[1]:], reference.argmax(-1))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()
