"""Hostile or careless inputs to the model and its cache (issue 44): saved cache files whose values, version, token
record or contents were changed; one cache shared by two concurrent generate() calls; masks that are not 0/1; cache
dtypes the model cannot use; packed-sequence inputs that disagree; malformed ids, masks and caches; static caches too
large for memory; the static cache's decode step under torch.compile(fullgraph=True)."""

import gc
import resource
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LogitsProcessor, LogitsProcessorList

from transformers_k3 import (KimiK3CacheError, KimiK3ForCausalLM, KimiK3HybridCache, KimiK3InputError,
                             KimiK3TextConfig)

from references import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")


def greedy(model, ids, n, **kwargs):
    return model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)


def conversation(model, seed, length=8, n=3):
    prompt = torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(seed))
    out = model.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                         return_dict_in_generate=True)
    return out.sequences, out.past_key_values


def read(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def rewrite(path, tensors, metadata):
    save_file(tensors, str(path), metadata=metadata)


# ---------------------------------------------------------------- saved cache files
@pytest.fixture
def saved(tiny_model, tmp_path):
    sequences, cache = conversation(tiny_model, seed=11)
    path = tmp_path / "a.safetensors"
    cache.save(path)
    return path, sequences


def test_spliced_latents_of_another_conversation_of_equal_length_are_refused(tiny_model, saved, tmp_path):
    path, sequences = saved
    other_sequences, other = conversation(tiny_model, seed=12)
    other.save(tmp_path / "b.safetensors")
    tensors, metadata = read(path)
    other_tensors, _ = read(tmp_path / "b.safetensors")
    assert tensors["layers.2.latent"].shape == other_tensors["layers.2.latent"].shape
    tensors["layers.2.latent"] = other_tensors["layers.2.latent"]
    rewrite(path, tensors, metadata)
    for trust in (False, True):  # (trust_unverified admits files without a digest, never a wrong one)
        with pytest.raises(KimiK3CacheError, match="content digest"):
            KimiK3HybridCache.load(path, tiny_model.config, model=tiny_model, trust_unverified=trust)
    # the tokens of the other conversation over this one's states: refused the same way
    tensors, metadata = read(tmp_path / "b.safetensors")
    tensors["tokens"] = read(path)[0]["tokens"]
    rewrite(path, tensors, metadata)
    with pytest.raises(KimiK3CacheError, match="content digest"):
        KimiK3HybridCache.load(path, tiny_model.config, model=tiny_model)


def test_forged_token_ids_that_match_any_prompt_are_refused(tiny_model, saved):
    path, sequences = saved
    tensors, metadata = read(path)
    tensors["tokens"] = torch.full_like(tensors["tokens"], -2)  # "unknown": would match any prompt
    rewrite(path, tensors, metadata)
    with pytest.raises(KimiK3CacheError, match="content digest"):
        KimiK3HybridCache.load(path, tiny_model.config)
    # the same forgery with the digest dropped (an older format's file): refused unless the caller trusts it
    metadata.pop("content_digest", None)
    metadata["version"] = "2"
    rewrite(path, tensors, metadata)
    with pytest.raises(KimiK3CacheError, match="trust_unverified=True"):
        KimiK3HybridCache.load(path, tiny_model.config, model=tiny_model)


@pytest.mark.parametrize("version", ["1", "2"])
def test_a_file_rewritten_as_an_older_version_is_refused_unless_trusted(tiny_model, saved, version):
    path, sequences = saved
    tensors, metadata = read(path)
    metadata.pop("content_digest", None)
    metadata["version"] = version
    if version == "1":
        tensors.pop("tokens")
        for key in ("lengths", "batch_size", "weights_fingerprint"):
            metadata.pop(key)
    rewrite(path, tensors, metadata)
    with pytest.raises(KimiK3CacheError, match=rf"version {version}.*trust_unverified=True"):
        KimiK3HybridCache.load(path, tiny_model.config, model=tiny_model)
    with pytest.warns(UserWarning, match="unverified"):
        restored = KimiK3HybridCache.load(path, tiny_model.config, model=tiny_model, trust_unverified=True)
    assert restored.get_seq_length() == sequences.shape[1] - 1


def test_an_unfingerprinted_file_is_refused_unless_trusted(tiny_model, tmp_path):
    writer = randomize_(KimiK3ForCausalLM(tiny_model.config).eval(), seed=3)
    cache = KimiK3HybridCache(tiny_model.config)
    with torch.no_grad():
        writer(torch.randint(3, 512, (1, 5)), past_key_values=cache, use_cache=True)
    del writer
    gc.collect()  # (the cache keeps only a weak reference to the model that wrote it: no fingerprint is known now)
    cache.save(tmp_path / "c.safetensors")
    with pytest.raises(KimiK3CacheError, match="without a weights fingerprint.*trust_unverified=True"):
        KimiK3HybridCache.load(tmp_path / "c.safetensors", tiny_model.config)
    with pytest.warns(UserWarning, match="without a weights fingerprint"):
        KimiK3HybridCache.load(tmp_path / "c.safetensors", tiny_model.config, trust_unverified=True)


@pytest.mark.parametrize("name, value", [("layers.0.recurrent_state", float("nan")),
                                         ("layers.2.latent", float("inf")), ("layers.1.conv_state", float("nan"))])
def test_non_finite_states_are_refused_even_when_trusted(tiny_model, saved, name, value):
    path, _ = saved
    tensors, metadata = read(path)
    tensors[name].view(-1)[3] = value
    metadata.pop("content_digest", None)
    metadata["version"] = "2"  # (no digest to recompute: the value check alone must catch it)
    rewrite(path, tensors, metadata)
    with pytest.raises(KimiK3CacheError, match=rf"`{name}` holds 1 non-finite value"):
        KimiK3HybridCache.load(path, tiny_model.config, trust_unverified=True)


def test_a_record_of_unknown_tokens_is_refused_unless_trusted(tiny_model, tmp_path):
    """A cache fed inputs_embeds without ids cannot be checked against a prompt: its file is not reused blindly."""
    cache = KimiK3HybridCache(tiny_model.config)
    with torch.no_grad():
        embeds = tiny_model.get_input_embeddings()(torch.randint(3, 512, (1, 5)))
        tiny_model(inputs_embeds=embeds, past_key_values=cache, use_cache=True)
    cache.save(tmp_path / "e.safetensors")
    with pytest.raises(KimiK3CacheError, match="unknown.*trust_unverified=True"):
        KimiK3HybridCache.load(tmp_path / "e.safetensors", tiny_model.config, model=tiny_model)
    KimiK3HybridCache.load(tmp_path / "e.safetensors", tiny_model.config, model=tiny_model, trust_unverified=True)


def test_a_verified_file_still_continues_exactly(tiny_model, saved, tmp_path):
    path, sequences = saved
    restored = KimiK3HybridCache.load(path, tiny_model.config, model=tiny_model)
    history = torch.cat([sequences, torch.randint(3, 512, (1, 2))], 1)
    assert torch.equal(greedy(tiny_model, history, 3, past_key_values=restored), greedy(tiny_model, history, 3))
    # saved again with no model known, a loaded cache keeps the fingerprint it was loaded with
    restored.save(tmp_path / "again.safetensors")
    KimiK3HybridCache.load(tmp_path / "again.safetensors", tiny_model.config, model=tiny_model)


def test_a_signed_file_loads_only_with_its_key_and_a_recomputed_digest_does_not_fool_it(tiny_model, tmp_path):
    from transformers_k3.cache_io import _content_digest

    sequences, cache = conversation(tiny_model, seed=13)
    key = b"k" * 32
    path = tmp_path / "signed.safetensors"
    cache.save(path, key=key)
    restored = KimiK3HybridCache.load(path, tiny_model.config, model=tiny_model, key=key)
    assert torch.equal(restored.token_ids, sequences[:, :-1])
    with pytest.raises(KimiK3CacheError, match="not signed with this key"):
        KimiK3HybridCache.load(path, tiny_model.config, key=b"x" * 32)
    # a forger who changes the states and recomputes the (keyless) digest passes the digest, not the signature
    tensors, metadata = read(path)
    tensors["layers.2.latent"] = tensors["layers.2.latent"] * 0.5
    metadata["content_digest"] = _content_digest(tensors, metadata)
    rewrite(path, tensors, metadata)
    KimiK3HybridCache.load(path, tiny_model.config)
    with pytest.raises(KimiK3CacheError, match="wrong signature"):
        KimiK3HybridCache.load(path, tiny_model.config, key=key, trust_unverified=True)
    cache.save(path)  # unsigned
    with pytest.raises(KimiK3CacheError, match="no signature"):
        KimiK3HybridCache.load(path, tiny_model.config, key=key)
    with pytest.raises(KimiK3CacheError, match="at least 16"):
        cache.save(path, key=b"short")


# ---------------------------------------------------------------- one cache, two concurrent generate() calls
class Pause(LogitsProcessor):
    """Holds the generate() it runs in at its first step until `release` is set (or raises there)."""

    def __init__(self, fail=False):
        self.started, self.release, self.fail = threading.Event(), threading.Event(), fail

    def __call__(self, input_ids, scores):
        self.started.set()
        assert self.release.wait(30)
        if self.fail:
            raise RuntimeError("stopped")
        return scores


def test_a_cache_in_use_refuses_a_second_concurrent_generate(tiny_model):
    prompt = torch.randint(3, 512, (1, 6), generator=torch.Generator().manual_seed(5))
    want = greedy(tiny_model, prompt, 4)
    cache = KimiK3HybridCache(tiny_model.config)
    pause, result = Pause(), {}

    def first():
        result["first"] = greedy(tiny_model, prompt, 4, past_key_values=cache,
                                 logits_processor=LogitsProcessorList([pause]))

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert pause.started.wait(30)
        with pytest.raises(KimiK3CacheError, match="in use by another generate"):
            greedy(tiny_model, prompt, 4, past_key_values=cache)
        with pytest.raises(KimiK3CacheError, match="in use by a generate.*another thread"), torch.no_grad():
            tiny_model(prompt, past_key_values=cache, use_cache=True)
    finally:
        pause.release.set()
        thread.join(60)
    assert torch.equal(result["first"], want)
    # usable again once the first call is done: a continuation equals a fresh run
    history = torch.cat([result["first"], prompt[:, :2]], 1)
    assert torch.equal(greedy(tiny_model, history, 3, past_key_values=cache), greedy(tiny_model, history, 3))
    # and after a generate() that raised
    failing = Pause(fail=True)
    failing.release.set()
    cache.reset()
    with pytest.raises(RuntimeError, match="stopped"):
        greedy(tiny_model, prompt, 4, past_key_values=cache, logits_processor=LogitsProcessorList([failing]))
    cache.reset()
    assert torch.equal(greedy(tiny_model, prompt, 3, past_key_values=cache), want[:, :9])


# ---------------------------------------------------------------- masks
def test_a_mask_holding_other_values_than_0_and_1_is_refused(tiny_model):
    ids = torch.randint(3, 512, (2, 6))
    for value in (2, 0.5, -1):
        mask = torch.ones(2, 6, dtype=torch.float32 if value == 0.5 else torch.long)
        mask[1, 0] = value
        with pytest.raises(KimiK3InputError, match=r"attention_mask must hold only 0 and 1.*row 1, position 0"):
            tiny_model(ids, attention_mask=mask)
        with pytest.raises(KimiK3InputError, match=r"attention_mask must hold only 0 and 1"):
            greedy(tiny_model, ids, 2, attention_mask=mask)
    # bool, float and integer masks of 0 and 1 are taken alike
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    with torch.no_grad():
        want = tiny_model(ids, attention_mask=mask).logits
        for kind in (torch.bool, torch.float32, torch.int32):
            torch.testing.assert_close(tiny_model(ids, attention_mask=mask.to(kind)).logits, want)


# ---------------------------------------------------------------- malformed ids, masks and caches
@pytest.mark.parametrize("shape", [(0, 5), (5,), (1, 2, 3)])
def test_input_ids_of_the_wrong_shape(tiny_model, shape):
    ids = torch.randint(3, 512, shape)
    with pytest.raises(KimiK3InputError, match=r"input_ids must be \[batch, tokens\]"):
        tiny_model(ids)
    with pytest.raises(KimiK3InputError, match=r"input_ids must be \[batch, tokens\]"):
        greedy(tiny_model, ids, 2)


def test_a_mask_shorter_than_the_ids_or_of_another_batch(tiny_model):
    ids = torch.randint(3, 512, (2, 6))
    for mask in (torch.ones(2, 4, dtype=torch.long), torch.ones(3, 6, dtype=torch.long)):
        with pytest.raises(KimiK3InputError, match=r"attention_mask of shape .* does not cover input_ids"):
            tiny_model(ids, attention_mask=mask)
        with pytest.raises(KimiK3InputError, match=r"attention_mask of shape .* does not cover input_ids"):
            greedy(tiny_model, ids, 2, attention_mask=mask)


def test_a_cache_built_for_another_layer_layout(tiny_model):
    kinds = tiny_model.config.linear_attn_config
    fewer = KimiK3TextConfig.tiny(num_hidden_layers=3,
                                  linear_attn_config={**kinds, "kda_layers": [1, 2], "full_attn_layers": [3]})
    ids = torch.randint(3, 512, (1, 4))
    with pytest.raises(KimiK3CacheError, match="built for 3 layers.*6"):
        tiny_model(ids, past_key_values=KimiK3HybridCache(fewer), use_cache=True)
    with pytest.raises(KimiK3CacheError, match="built for 3 layers.*6"):
        greedy(tiny_model, ids, 2, past_key_values=KimiK3HybridCache(fewer))


# ---------------------------------------------------------------- cache dtypes
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_a_cache_dtype_the_model_cannot_use_is_refused(tiny_model, dtype):
    with pytest.raises(KimiK3CacheError, match="floating-point dtype"):
        KimiK3HybridCache(tiny_model.config, dtype=dtype)


def test_a_static_cache_in_another_dtype_than_the_model_is_refused(tiny_model):
    cache = KimiK3HybridCache(tiny_model.config, max_cache_len=16, static=True, dtype=torch.bfloat16)
    with pytest.raises(KimiK3CacheError, match=r"static .*bfloat16.*float32"), torch.no_grad():
        tiny_model(torch.randint(3, 512, (1, 4)), past_key_values=cache, use_cache=True)
    # the growing cache stores another dtype and casts it back per step, as documented
    grown = KimiK3HybridCache(tiny_model.config, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.isfinite(tiny_model(torch.randint(3, 512, (1, 4)), past_key_values=grown, use_cache=True)
                              .logits).all()


# ---------------------------------------------------------------- packed sequences
def packed_row(lengths=(3, 4, 2)):
    ids = torch.randint(3, 512, (1, sum(lengths)), generator=torch.Generator().manual_seed(9))
    return ids, torch.cat([torch.arange(n) for n in lengths])[None]


@pytest.mark.parametrize("kind", ["negative", "fractional", "short", "long", "jump"])
def test_packed_position_ids_that_make_no_sense_are_refused(tiny_model, kind):
    ids, positions = packed_row()
    if kind == "negative":
        positions[0, 4] = -1
    elif kind == "fractional":
        positions = positions.float() + 0.5
    elif kind == "short":
        positions = positions[:, :-2]
    elif kind == "long":
        positions = torch.cat([positions, torch.arange(3)[None]], 1)
    else:
        positions[0, 5] = 7
    with pytest.raises(KimiK3InputError, match="position_ids"), torch.no_grad():
        tiny_model(ids, position_ids=positions)


def test_cu_seq_lens_that_disagree_with_position_ids_are_refused(tiny_model):
    ids, positions = packed_row()
    with torch.no_grad():
        want = tiny_model(ids, position_ids=positions).logits
        cu = torch.tensor([0, 3, 7, 9], dtype=torch.int32)
        torch.testing.assert_close(tiny_model(ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits,
                                   want)
        for bad in ([0, 4, 7, 9], [0, 3, 7, 8], [0, 7, 3, 9], [1, 3, 7, 9]):
            bad = torch.tensor(bad, dtype=torch.int32)
            with pytest.raises(KimiK3InputError, match="cu_seq_lens_q"):
                tiny_model(ids, position_ids=positions, cu_seq_lens_q=bad, cu_seq_lens_k=bad)
        with pytest.raises(KimiK3InputError, match="cu_seq_lens_q"):  # without position_ids: not a split of the row
            tiny_model(ids, cu_seq_lens_q=torch.tensor([0, 7, 3, 9], dtype=torch.int32))


def test_a_packed_row_from_a_cache_is_refused_and_continued_positions_work(tiny_model):
    """A cache holds one sequence's state per row: a row packing several sequences (position_ids restarting at 0,
    cu_seq_lens of several sequences) given with a cache, filled or empty, is refused by name (it used to run as one
    sequence, the KDA state and MLA latents carried from one into the next) and leaves the cache as it was; positions
    that continue the cache's, and a mask's positions (left padding restarts them), run as without positions."""
    ids, positions = packed_row()
    prefix = torch.randint(3, 512, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = tiny_model(torch.cat([prefix, ids], 1)).logits[:, 5:]
        for fill in (prefix, None):
            cache = KimiK3HybridCache(tiny_model.config)
            if fill is not None:
                tiny_model(fill, past_key_values=cache, use_cache=True)
            with pytest.raises(KimiK3InputError, match=r"one sequence's state per row.*position_ids restarting at 0 "
                                                       r"at token 3 of row 0.*without past_key_values"):
                tiny_model(ids, past_key_values=cache, position_ids=positions)
            for cu in ("cu_seq_lens_q", "cu_seq_lens_k"):
                with pytest.raises(KimiK3InputError, match=rf"one sequence's state per row.*{cu} of 3 sequences"):
                    tiny_model(ids, past_key_values=cache, **{cu: torch.tensor([0, 3, 7, 9], dtype=torch.int32)})
        # the refused steps changed nothing: the filled cache continues, with positions that continue its own
        cache = KimiK3HybridCache(tiny_model.config)
        tiny_model(prefix, past_key_values=cache, use_cache=True)
        with pytest.raises(KimiK3InputError, match="one sequence's state per row"):
            tiny_model(ids, past_key_values=cache, position_ids=positions)
        got = tiny_model(ids, past_key_values=cache, position_ids=torch.arange(5, 14)[None]).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # a packed row without a cache is still its sequences, each from the start
        separate = torch.cat([tiny_model(ids[:, a:b]).logits for a, b in ((0, 3), (3, 7), (7, 9))], 1)
        torch.testing.assert_close(tiny_model(ids, position_ids=positions).logits, separate, atol=1e-5, rtol=1e-5)
        # under a mask, positions restarting at 0 are generate()'s after left padding, not packing: not refused
        mask = torch.ones(1, 14, dtype=torch.long)
        cache = KimiK3HybridCache(tiny_model.config)
        tiny_model(prefix, attention_mask=mask[:, :5], past_key_values=cache, use_cache=True)
        masked = tiny_model(ids, attention_mask=mask, past_key_values=cache, position_ids=positions).logits
        torch.testing.assert_close(masked, want, atol=1e-5, rtol=1e-5)


def test_several_rows_packing_sequences_are_refused_and_plain_rows_run(tiny_model):
    """Several rows with no cache and no mask whose position_ids break (as one packed row's do) are refused by name:
    transformers' mask splits MLA's attention at the break while KDA's state would run on through the row. Rows that
    step by +1 (from any start) run as without positions, and the same sequences packed in one row are each from
    the start."""
    ids, positions = packed_row()
    rows = ids.repeat(2, 1)
    with torch.no_grad():
        want = tiny_model(rows).logits
        for given in (positions.repeat(2, 1), positions):  # per row, and one row broadcast over the batch
            with pytest.raises(KimiK3InputError, match=r"one row only: 2 rows whose position_ids break \(from 2 to 0 "
                                                       r"at token 3 of row 0\).*DataCollatorWithFlattening"):
                tiny_model(rows, position_ids=given)
        jump = torch.arange(9).repeat(2, 1)
        jump[1, 5:] += 4
        with pytest.raises(KimiK3InputError, match=r"from 4 to 9 at token 5 of row 1"):
            tiny_model(rows, position_ids=jump)
        with pytest.raises(KimiK3InputError, match=r"cu_seq_lens_q of 3 sequences"):
            tiny_model(rows, cu_seq_lens_q=torch.tensor([0, 3, 7, 9], dtype=torch.int32))
        torch.testing.assert_close(tiny_model(rows, position_ids=torch.arange(9).repeat(2, 1) + 5).logits, want,
                                   atol=1e-5, rtol=1e-5)
        separate = torch.cat([tiny_model(ids[:, a:b]).logits for a, b in ((0, 3), (3, 7), (7, 9))], 1)
        torch.testing.assert_close(tiny_model(ids, position_ids=positions).logits, separate, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- static cache sizes
def test_a_static_cache_larger_than_memory_is_refused_before_it_is_allocated(tiny_model):
    ids = torch.randint(3, 512, (1, 6))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(KimiK3CacheError, match=r"static cache .* needs [\d.]+ GB.*max_new_tokens"):
        greedy(tiny_model, ids, 10**9, cache_implementation="static")
    with pytest.raises(KimiK3CacheError, match=r"needs [\d.]+ GB.*max_cache_len"):
        KimiK3HybridCache(tiny_model.config, max_cache_len=10**9, batch_size=1, static=True)
    cache = KimiK3HybridCache(tiny_model.config, max_cache_len=10**9, static=True)  # (allocated at its first forward)
    with pytest.raises(KimiK3CacheError, match=r"needs [\d.]+ GB.*max_cache_len"), torch.no_grad():
        tiny_model(ids, past_key_values=cache, use_cache=True)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024
    # a size that fits is taken as before
    assert greedy(tiny_model, ids, 3, cache_implementation="static").shape == (1, 9)


def test_the_size_check_counts_each_layer_on_its_own_device():
    """A model split over devices (a device_map) holds each layer's state where the layer computes: only the part on
    a device counts against that device's memory (meta stands in for a second device, whose memory is not known)."""
    from transformers_k3.cache import KimiK3CacheSizeError, available_bytes, check_cache_fits

    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()
    config = model.config
    per_token = config.kv_lora_rank + config.qk_rope_head_dim  # fp32 elements of one MLA layer's latent
    tokens = int(available_bytes("cpu") * 0.7 / (per_token * 4))  # each of the two MLA layers: 70 % of the RAM
    with pytest.raises(KimiK3CacheSizeError, match="on cpu"):
        check_cache_fits(config, tokens, 1, torch.float32, "cpu", model=model)
    model.model.layers[5].to("meta")  # one MLA layer elsewhere: what is left fits
    check_cache_fits(config, tokens, 1, torch.float32, "cpu", model=model)


# ---------------------------------------------------------------- compiled decode through the static cache
@pytest.mark.slow
def test_a_compiled_fullgraph_decode_step_through_the_static_cache(tiny_model):
    ids = torch.randint(3, 512, (1, 11), generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    with torch.no_grad():
        want = tiny_model(ids, use_cache=False).logits
        cache = KimiK3HybridCache(tiny_model.config, max_cache_len=16, static=True)
        tiny_model(ids[:, :8], past_key_values=cache, use_cache=True)
        compiled = torch.compile(tiny_model, fullgraph=True)
        got = [compiled(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits for i in range(8, 11)]
    torch.testing.assert_close(torch.cat(got, 1), want[:, 8:], atol=2e-5, rtol=1e-4)
    assert cache.get_seq_length() == 11 and torch.equal(cache.token_ids, ids)
