"""Inputs that used to give a wrong answer or a raw torch error get a named error that says what to do
(issue 27): no tokens, ids outside the vocabulary, right padding in generate(), prefill chunk sizes that are
not token counts, video frame rates that are not rates; generate() in train mode keeps its cache."""

import numpy as np
import pytest
import torch

from transformers_k3 import KimiK3ForCausalLM, KimiK3InputError, KimiK3TextConfig, KimiK3VideoProcessor
from transformers_k3.video_processing_kimi_k3 import KimiK3VideoInputError

from references import randomize_


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny())).eval()


@pytest.fixture(scope="module")
def ids(model):
    return torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))


def test_no_tokens(model):
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(KimiK3InputError, match=r"input_ids with no tokens \(shape \(1, 0\)\).*bos_token_id"):
        model.generate(empty, max_new_tokens=2)
    with pytest.raises(KimiK3InputError, match=r"input_ids has no tokens"):
        model(empty)
    with pytest.raises(KimiK3InputError, match=r"inputs_embeds must be \[batch, tokens, hidden\]"):
        model(inputs_embeds=torch.zeros(1, 0, model.config.hidden_size))


@pytest.mark.parametrize("bad", [-1, 0, 5])  # offsets from the vocabulary's end: -1 is the first id past it
def test_ids_outside_the_vocabulary(model, bad):
    vocab = model.config.vocab_size
    value = -1 if bad == -1 else vocab + bad
    ids = torch.tensor([[3, 4, value, 5]])
    with pytest.raises(KimiK3InputError, match=rf"id {value} at position \(0, 2\), outside .*\[0, {vocab}\)"):
        model(ids)
    with pytest.raises(KimiK3InputError, match="resize_token_embeddings"):
        model.generate(ids, max_new_tokens=2)


def test_float_ids(model):
    with pytest.raises(KimiK3InputError, match="integer token ids, got a torch.float32"):
        model(torch.ones(1, 3))


def test_the_last_id_of_the_vocabulary_is_fine(model):
    ids = torch.tensor([[0, model.config.vocab_size - 1]])
    assert torch.isfinite(model(ids).logits).all()


def test_after_resize_the_new_ids_are_accepted(ids):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()
    vocab = model.config.vocab_size
    with pytest.raises(KimiK3InputError):
        model(torch.tensor([[vocab]]))
    model.resize_token_embeddings(vocab + 8)
    assert torch.isfinite(model(torch.tensor([[vocab + 7]])).logits).all()


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True])
def test_prefill_chunk_size_must_be_a_token_count(model, ids, chunk):
    with pytest.raises(KimiK3InputError, match=rf"prefill_chunk_size must be a whole number of tokens >= 1.*{chunk}"):
        model.generate(ids[:1], max_new_tokens=2, prefill_chunk_size=chunk)


def test_chunked_prefill_equals_one_prefill(model, ids):
    whole = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    for chunk in (1, 4, 100):
        assert torch.equal(model.generate(ids[:1], max_new_tokens=4, do_sample=False, prefill_chunk_size=chunk), whole)


def test_right_padding_is_refused_and_left_padding_matches_unpadded(model, ids):
    right = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    with pytest.raises(KimiK3InputError, match=r"row 1 ends in padding \(right padding\).*padding_side = 'left'"):
        model.generate(ids, attention_mask=right, max_new_tokens=2)
    with pytest.raises(KimiK3InputError, match="row 1 attends to no token"):
        model.generate(ids, attention_mask=torch.tensor([[1] * 6, [0] * 6]), max_new_tokens=2)
    # the same short row, padded on the left, generates what it generates alone
    short = ids[1:, :4]
    left_ids = torch.cat([torch.zeros(1, 2, dtype=torch.long), short], dim=1)
    batch = torch.cat([ids[:1], left_ids])
    mask = torch.tensor([[1] * 6, [0] * 2 + [1] * 4])
    out = model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    alone = model.generate(short, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out[1, 6:], alone[0, 4:])


def test_a_hole_in_the_mask_names_the_padding_generate_takes(model, ids):
    with pytest.raises(ValueError, match=r"masks position 2 of row 0 between attended tokens.*not in generate\(\)"):
        model(ids[:1], attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1]]))


def test_generate_in_train_mode_with_checkpointing_keeps_the_cache(model, ids):
    eval_tokens = model.generate(ids[:1], max_new_tokens=5, do_sample=False)
    model.train()
    model.gradient_checkpointing_enable()
    try:
        calls = []
        hook = model.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(
            (kwargs["input_ids"].shape[1], kwargs["past_key_values"])), with_kwargs=True)
        try:
            train_tokens = model.generate(ids[:1], max_new_tokens=5, do_sample=False)
        finally:
            hook.remove()
        assert torch.equal(train_tokens, eval_tokens)
        # one prefill of the prompt, then one token a step into the same hybrid cache (not the whole sequence again)
        assert [n for n, _ in calls] == [6, 1, 1, 1, 1]
        assert calls[-1][1] is calls[0][1] and calls[-1][1].get_seq_length() == 10
        # the flags are back: training still checkpoints
        assert model.model.gradient_checkpointing and all(layer.gradient_checkpointing for layer in model.model.layers)
        assert model.training
    finally:
        model.gradient_checkpointing_disable()
        model.eval()


# ---------------------------------------------------------------- video frame rates
def frames(n=6):
    return np.random.RandomState(0).randint(0, 256, (n, 28, 28, 3), dtype=np.uint8)


@pytest.mark.parametrize("fps", [0, -1, float("nan"), float("inf"), "fast"])
def test_video_fps_must_be_a_positive_rate(fps):
    processor = KimiK3VideoProcessor()
    with pytest.raises(KimiK3VideoInputError, match=r"fps must be a (finite )?number of frames per second"):
        processor.process_video(frames(), metadata={"fps": 30}, fps=fps)
    with pytest.raises(KimiK3VideoInputError, match=r"fps must be a"):
        KimiK3VideoProcessor(fps=fps)


@pytest.mark.parametrize("source", [-30, float("nan"), "x"])
def test_source_fps_in_the_metadata_must_be_a_rate(source):
    with pytest.raises(KimiK3VideoInputError, match=r"video_metadata fps \(the source video's frame rate\)"):
        KimiK3VideoProcessor().process_video(frames(), metadata={"fps": source})


def test_unknown_source_fps_takes_the_frames_as_sampled():
    processor = KimiK3VideoProcessor()
    for metadata in (None, {"fps": None}, {"fps": 0}):
        assert processor.process_video(frames(), metadata=metadata)["grids"] == [(4, 2, 2), (2, 2, 2)]


def test_num_frames_and_max_frames_are_counts():
    processor = KimiK3VideoProcessor()
    for bad in (0, -2, 2.5):
        with pytest.raises(KimiK3VideoInputError, match="num_frames must be an integer >= 1"):
            processor.process_video(frames(), num_frames=bad)
    with pytest.raises(KimiK3VideoInputError, match="max_frames must be an integer >= 1"):
        KimiK3VideoProcessor(max_frames=0)
    # 30 fps source sampled at 10 fps: every third frame of 12 -> 4 frames, one chunk
    assert processor.process_video(frames(12), metadata={"fps": 30}, fps=10)["grids"] == [(4, 2, 2)]


def test_multimodal_model_without_a_media_placeholder_id():
    """A composite config whose ``media_placeholder_token_id`` is null (the release's id outside a small vocabulary)
    runs and generates text (the slot check compared ids with None and crashed every call), and media inputs name
    the field to set."""
    from transformers_k3 import KimiK3Config, KimiK3ConfigError, KimiK3ForConditionalGeneration

    config = KimiK3Config.tiny()
    config.media_placeholder_token_id = None
    torch.manual_seed(0)
    vl = KimiK3ForConditionalGeneration(config).eval()
    randomize_(vl)
    text = KimiK3ForCausalLM(config.text_config).eval()
    text.load_state_dict({k[len("language_model."):]: v for k, v in vl.state_dict().items()
                          if k.startswith("language_model.")})
    prompt = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():
        torch.testing.assert_close(vl(prompt).logits, text(prompt).logits, rtol=0, atol=0)
        assert torch.equal(vl.generate(prompt, max_new_tokens=3, do_sample=False),
                           text.generate(prompt, max_new_tokens=3, do_sample=False))
        with pytest.raises(KimiK3ConfigError, match="media_placeholder_token_id.*<\\|media_pad\\|>"):
            vl(prompt, pixel_values=torch.zeros(4, 3, 14, 14), image_grid_thw=torch.tensor([[1, 2, 2]]))
