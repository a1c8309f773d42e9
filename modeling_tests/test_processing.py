"""K3 image / video processing and the processor: spec 7.6 resize and token counts, 7.7 prompt expansion, the
chat template of spec 8, clear errors, save/load."""

import math

import numpy as np
import pytest
import torch
from transformers import AutoImageProcessor, AutoProcessor

from transformers_k3 import KimiK3ImageProcessor, KimiK3Processor, KimiK3VideoProcessor
from transformers_k3.image_processing_kimi_k3 import KimiK3ImageInputError
from transformers_k3.encoding_kimi_k3 import KimiK3ChatError
from transformers_k3.processing_kimi_k3 import KimiK3ProcessorError
from transformers_k3.video_processing_kimi_k3 import KimiK3VideoInputError

Image = pytest.importorskip("PIL.Image")

PAD_ID = 500
MEDIA_PAD = "<|media_pad|>"


def spec_grid(width, height, limit=16384, side=512, p=14, m=2):
    """Spec 7.6 steps 2, 7, 8, written out independently: (grid_h, grid_w, tokens)."""
    s1 = math.sqrt(limit / (max(1, width // p) * max(1, height // p)))
    scale = min(1.0, s1, side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    padded_w = new_w + (p * m - new_w % (p * m)) % (p * m)
    padded_h = new_h + (p * m - new_h % (p * m)) % (p * m)
    return padded_h // p, padded_w // p, (padded_h // p) * (padded_w // p) // (m * m)


def rgb(width, height, seed=0):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


# ---------------------------------------------------------------- token counts and shapes (spec 7.6 / 11.1.13)
@pytest.mark.parametrize(
    "size, limits",
    [
        ((1, 1), {}),  # tiny
        ((5, 3), {}),
        ((56, 56), {}),  # the spec's example: grid (1, 4, 4), 4 tokens
        ((97, 61), {}),  # odd
        ((2000, 30), {}),  # very wide, within the limits
        ((8000, 14), {}),  # very wide, above the per-side limit (7168 px)
        ((30, 3000), {}),  # very tall
        ((200, 200), {"in_patch_limit": 64, "patch_limit_on_one_side": 16}),  # above the total patch limit
        ((1000, 20), {"in_patch_limit": 64, "patch_limit_on_one_side": 16}),  # above the per-side limit
        ((41, 333), {"in_patch_limit": 64, "patch_limit_on_one_side": 16}),
    ],
)
def test_token_count_grid_and_pixels_follow_the_spec(tokenizer, size, limits):
    width, height = size
    proc = KimiK3Processor(KimiK3ImageProcessor(**limits), KimiK3VideoProcessor(), tokenizer)
    out = proc(text=f"look: {MEDIA_PAD}!", images=[rgb(width, height)], return_tensors="pt")
    gh, gw, tokens = spec_grid(width, height, limits.get("in_patch_limit", 16384),
                               limits.get("patch_limit_on_one_side", 512))
    assert out["image_grid_thw"].tolist() == [[1, gh, gw]]
    assert out["pixel_values"].shape == (gh * gw, 3, 14, 14)
    assert int((out["input_ids"] == PAD_ID).sum()) == tokens
    assert proc.get_number_of_image_tokens(width, height) == tokens
    # the span states the ORIGINAL size, width first
    text = tokenizer.decode(out["input_ids"][0])
    assert f"<|media_begin|>image {width}x{height}<|media_content|>{MEDIA_PAD * tokens}<|media_end|>" in text


def test_spec_example_56x56_expands_exactly(processor, tokenizer):
    out = processor(text=f"a{MEDIA_PAD}b", images=rgb(56, 56))
    assert tokenizer.decode(out["input_ids"][0]) == (
        f"a<|media_begin|>image 56x56<|media_content|>{MEDIA_PAD * 4}<|media_end|>b")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert out["mm_token_type_ids"][0] == [1 if i == PAD_ID else 0 for i in out["input_ids"][0]]


def test_normalisation_and_black_padding_before_normalising():
    proc = KimiK3ImageProcessor(image_mean=[0.5, 0.4, 0.3], image_std=[0.5, 0.25, 0.2])
    color = (200, 100, 50)
    image = Image.new("RGB", (30, 20), color)  # padded to 56 x 28: grid 2 x 4
    out = proc(image)
    assert out["image_grid_thw"].tolist() == [[1, 2, 4]]
    canvas = out["pixel_values"].reshape(2, 4, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 28, 56)
    mean, std = torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.5, 0.25, 0.2])
    inside = (torch.tensor(color) / 255 - mean) / std
    torch.testing.assert_close(canvas[:, :20, :30], inside[:, None, None].expand(3, 20, 30))
    torch.testing.assert_close(canvas[:, 20:, :], (-mean / std)[:, None, None].expand(3, 8, 56))
    torch.testing.assert_close(canvas[:, :, 30:], (-mean / std)[:, None, None].expand(3, 28, 26))


def test_resize_is_pil_bicubic_and_never_upscales():
    image = rgb(200, 200, seed=3)
    proc = KimiK3ImageProcessor(in_patch_limit=64, patch_limit_on_one_side=16)  # -> 114 x 114
    out = proc(image)["pixel_values"]
    expected = np.asarray(image.resize((114, 114), Image.Resampling.BICUBIC), dtype=np.float32) / 255 * 2 - 1
    canvas = out.reshape(10, 10, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(140, 140, 3)
    torch.testing.assert_close(canvas[:114, :114], torch.from_numpy(expected))
    small = KimiK3ImageProcessor()(rgb(20, 20))["image_grid_thw"].tolist()
    assert small == [[1, 2, 2]]  # 20 px stays 20 px (padded to 28), not upscaled


def test_transparent_background(tokenizer):
    pixels = np.zeros((28, 28, 4), dtype=np.uint8)
    pixels[..., :3] = 100
    pixels[:, 14:, 3] = 255  # right half opaque, left half fully transparent
    image = Image.fromarray(pixels, mode="RGBA")
    for config, left in [(None, 100), ({"pattern": "white"}, 255), ({"pattern": "black"}, 0),
                         ({"pattern": "gray"}, 128)]:
        out = KimiK3ImageProcessor(transparent_bg_config=config)(image)["pixel_values"]
        canvas = ((out.reshape(2, 2, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(28, 28, 3) + 1) / 2 * 255).round()
        assert torch.all(canvas[:, :14] == left), config
        assert torch.all(canvas[:, 14:] == 100), config
    # chessboard: 16 px squares; with chessboard_square_on_top_left (default) the squares of odd
    # (row // 16 + col // 16) are gray (200), so the top-left square itself is white (spec 7.6 step 4)
    out = KimiK3ImageProcessor(transparent_bg_config={"pattern": "chessboard"})(
        Image.fromarray(np.zeros((28, 28, 4), np.uint8), mode="RGBA"))["pixel_values"]
    canvas = ((out.reshape(2, 2, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(28, 28, 3) + 1) / 2 * 255).round()
    assert canvas[0, 0, 0] == 255 and canvas[0, 16, 0] == 200 and canvas[16, 0, 0] == 200 and canvas[16, 16, 0] == 255


def test_image_modes(processor):
    gray = Image.fromarray(np.full((28, 28), 77, np.uint8), mode="L")
    out = KimiK3ImageProcessor()(gray)["pixel_values"]
    assert torch.allclose(out, torch.full_like(out, 77 / 255 * 2 - 1))  # replicated to 3 channels
    palette = gray.convert("P")
    torch.testing.assert_close(KimiK3ImageProcessor()(palette)["pixel_values"], out)
    array = np.full((28, 28, 3), 77, np.uint8)
    torch.testing.assert_close(KimiK3ImageProcessor()(array)["pixel_values"], out)
    torch.testing.assert_close(KimiK3ImageProcessor()(torch.from_numpy(array).permute(2, 0, 1))["pixel_values"], out)


# ---------------------------------------------------------------- errors
def test_unsupported_image_mode_and_dtype(processor):
    with pytest.raises(KimiK3ImageInputError, match="unsupported image mode 'F'"):
        processor(text=MEDIA_PAD, images=Image.new("F", (28, 28)))
    with pytest.raises(KimiK3ImageInputError, match="uint8"):
        processor(text=MEDIA_PAD, images=np.zeros((28, 28, 3), np.float32))


def test_oversized_image_without_resize_names_the_limit(processor):
    with pytest.raises(KimiK3ImageInputError, match="at most 16384 patches .* 512 per side, i.e. 7168px"):
        processor(text=MEDIA_PAD, images=rgb(7200, 20), do_resize=False)


def test_placeholder_and_media_counts_must_match(processor):
    with pytest.raises(KimiK3ProcessorError, match="2 image placeholders .* but 1 images"):
        processor(text=f"{MEDIA_PAD}{MEDIA_PAD}", images=[rgb(28, 28)])
    with pytest.raises(KimiK3ProcessorError, match="1 video placeholders .* but 0 videos"):
        processor(text="<|kimi_video_placeholder|>")


def test_empty_video_and_too_long_video(processor):
    with pytest.raises(KimiK3VideoInputError, match="empty video: it has 0 frames"):
        processor(text="<|kimi_video_placeholder|>", videos=[np.zeros((0, 28, 28, 3), np.uint8)])
    with pytest.raises(KimiK3VideoInputError, match="200 frames, more than max_frames=128"):
        processor(text="<|kimi_video_placeholder|>", videos=[np.zeros((200, 28, 28, 3), np.uint8)],
                  do_sample_frames=False)


# ---------------------------------------------------------------- video
def test_video_sampling_chunks_and_timestamps(processor, tokenizer):
    frames = np.random.RandomState(0).randint(0, 256, (10, 30, 60, 3), dtype=np.uint8)  # 60x30 -> grid 4 x 6
    out = processor(text="v:<|kimi_video_placeholder|>", videos=[frames], video_metadata={"fps": 4.0},
                    return_tensors="pt")
    # 10 frames at 4 fps sampled at 2 fps -> frames 0, 2, 4, 6, 8 -> chunks of 4 and 1 frames
    assert out["video_grid_thw"].tolist() == [[4, 4, 6], [1, 4, 6]]
    assert out["pixel_values_videos"].shape == (5 * 24, 3, 14, 14)
    assert tokenizer.decode(out["input_ids"][0]) == (
        f"v:00:00:00.000<|media_begin|>video<|media_content|>{MEDIA_PAD * 6}<|media_end|>"
        f"00:00:02.000<|media_begin|>video<|media_content|>{MEDIA_PAD * 6}<|media_end|>")
    assert out["mm_token_type_ids"][0].tolist() == [2 if i == PAD_ID else 0 for i in out["input_ids"][0].tolist()]
    # chunk 0 holds sampled frames 0, 2, 4, 6 in order (frame-major patches)
    single = KimiK3ImageProcessor(in_patch_limit=4096)(Image.fromarray(frames[2]))["pixel_values"]
    torch.testing.assert_close(out["pixel_values_videos"][24:48], single)


def test_video_without_metadata_and_num_frames(processor):
    video = [Image.fromarray(np.full((28, 28, 3), i, np.uint8)) for i in range(6)]
    vp = processor.video_processor
    item = vp.process_video(video)  # no source fps: frames taken as already sampled at 2 fps
    assert item["grids"] == [(4, 2, 2), (2, 2, 2)] and item["timestamps"] == [0.0, 2.0]
    item = vp.process_video(video, num_frames=3)
    assert item["grids"] == [(3, 2, 2)]


def test_images_and_videos_in_one_batch(processor):
    video = np.random.RandomState(1).randint(0, 256, (5, 28, 56, 3), dtype=np.uint8)
    out = processor(text=["<|kimi_video_placeholder|> then " + MEDIA_PAD, "plain text"],
                    images=[rgb(56, 28)], videos=[video], padding=True, return_tensors="pt")
    types = out["mm_token_type_ids"]
    ids = out["input_ids"]
    assert types.shape == ids.shape
    row = types[0][ids[0] == PAD_ID].tolist()
    assert row == [2] * (2 + 2) + [1] * 2  # two video chunks (t=4, t=1) of 2 tokens, then the image
    assert types[1].sum() == 0 and out["attention_mask"][1, 0] == 0  # left padding on the text-only row


# ---------------------------------------------------------------- chat template (spec 8)
# Expected strings written from the release encoder's rules (K3_SPEC.md 8, encoding_k3.py): without image prompts an
# image part is `<|kimi_image_placeholder|>`; past assistant turns carry a think block when thinking is on.
IMG = "<|kimi_image_placeholder|>"
CONVERSATION = [
    {"role": "system", "content": "You are Kimi."},
    {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                 {"type": "text", "text": " and "}, {"type": "image"}, {"type": "text", "text": "."}]},
    {"role": "assistant", "reasoning_content": "Both are cats.", "content": "Two cats."},
    {"role": "user", "content": "Thanks & bye"},
]
EXPECTED_THINKING = (
    '<|open|>message role="system"<|sep|>You are Kimi.<|close|>message<|sep|><|end_of_msg|>'
    f'<|open|>message role="user"<|sep|>Compare {IMG} and {IMG}.<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Both are cats.<|close|>think<|sep|>'
    '<|open|>response<|sep|>Two cats.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="user"<|sep|>Thanks & bye<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
)
EXPECTED_NO_THINKING = (
    '<|open|>message role="system"<|sep|>You are Kimi.<|close|>message<|sep|><|end_of_msg|>'
    f'<|open|>message role="user"<|sep|>Compare {IMG} and {IMG}.<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|>'
    '<|open|>response<|sep|>Two cats.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="user"<|sep|>Thanks & bye<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
)


def test_chat_template_renders_the_fixed_conversation_exactly(tokenizer, processor):
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == EXPECTED_THINKING
    assert processor.apply_chat_template(CONVERSATION, add_generation_prompt=True) == EXPECTED_THINKING
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True,
                                         thinking=False) == EXPECTED_NO_THINKING


def test_chat_template_effort_names_and_typed_placeholders(tokenizer):
    messages = [{"role": "developer", "content": "Rules."},
                {"role": "user", "name": 'A "B" & C', "content": f"x {IMG} y"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             thinking_effort="low")
    assert rendered == (
        '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think '
        'in your thinking channel (not including the response channel), supported values include `low`, `medium`, '
        '`high`, and `max`.\nNow the system is invoked with `thinking_effort=low`.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="system"<|sep|>Rules.<|close|>message<|sep|><|end_of_msg|>'
        f'<|open|>message role="user" name="A &quot;B&quot; &amp; C"<|sep|>x {IMG} y'
        '<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert rendered.count_control(IMG) == 0  # the typed placeholder is text, not a slot
    with pytest.raises(KimiK3ChatError, match="pass one of low, high, max"):
        tokenizer.apply_chat_template(messages, tokenize=False, thinking_effort="extreme")
    with pytest.raises(KimiK3ChatError, match="needs the tool's name"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "1"}], tokenize=False)


def _expanded(prompt: str, sizes_and_counts) -> str:
    for (width, height), count in sizes_and_counts:
        prompt = prompt.replace(IMG, f"<|media_begin|>image {width}x{height}<|media_content|>{MEDIA_PAD * count}"
                                     "<|media_end|>", 1)
    return prompt


def test_processor_chat_template_with_media_tokenizes_the_expanded_prompt(processor, tokenizer):
    images = [rgb(56, 28, seed=1), rgb(30, 40, seed=2)]
    conversation = [dict(m) for m in CONVERSATION]
    conversation[1] = {"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image", "image": images[0]}, {"type": "text", "text": " and "},
        {"type": "image", "image": images[1]}, {"type": "text", "text": "."}]}
    out = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")
    expanded = _expanded(EXPECTED_THINKING, [((56, 28), 2), ((30, 40), 4)])
    assert out["input_ids"][0].tolist() == tokenizer(expanded)["input_ids"]
    assert out["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 4]]
    # The two-step form (render, then call the processor) tokenizes the same ids.
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True)
    assert processor(text=[prompt], images=images)["input_ids"][0] == out["input_ids"][0].tolist()


@pytest.mark.parametrize("typed", [MEDIA_PAD, IMG, "<|kimi_video_placeholder|>"])
@pytest.mark.parametrize("n_images", [1, 2])
def test_typed_media_placeholders_never_take_an_image(processor, tokenizer, typed, n_images):
    images = [rgb(28, 28, seed=i) for i in range(n_images)]
    content = [{"type": "image", "image": image} for image in images] + [
        {"type": "text", "text": f"what is {typed} here {typed}?"}]
    conversation = [{"role": "user", "content": content}]
    out = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = out["input_ids"][0]
    per_image = processor.get_number_of_image_tokens(28, 28)
    assert ids.count(PAD_ID) == n_images * per_image  # only the image parts' slots
    assert sum(out["mm_token_type_ids"][0]) == n_images * per_image
    assert f"what is {typed} here {typed}?" in tokenizer.decode(ids)  # the typed text round-trips as text
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True)
    assert processor(text=prompt, images=images)["input_ids"][0] == ids


# ---------------------------------------------------------------- persistence and configuration
def test_save_and_reload(tmp_path, processor):
    processor.save_pretrained(tmp_path)
    reloaded = AutoProcessor.from_pretrained(tmp_path)
    assert isinstance(reloaded, KimiK3Processor)
    assert isinstance(reloaded.video_processor, KimiK3VideoProcessor)
    assert reloaded.chat_template == processor.chat_template
    kwargs = dict(text=[f"{MEDIA_PAD} hi"], images=[rgb(45, 33)], return_tensors="pt")
    a, b = processor(**kwargs), reloaded(**kwargs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_official_media_proc_cfg_is_read(tmp_path):
    cfg = {"media_proc_cfg": {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 1024,
                              "patch_limit_on_one_side": 64, "image_mean": [0.1, 0.2, 0.3],
                              "image_std": [0.3, 0.2, 0.1], "fixed_output_tokens": None,
                              "transparent_bg_config": {"pattern": "white"}},
           "image_processor_type": "KimiK3ImageProcessor"}
    import json

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    proc = AutoImageProcessor.from_pretrained(tmp_path)
    assert isinstance(proc, KimiK3ImageProcessor)
    assert (proc.in_patch_limit, proc.patch_limit_on_one_side, proc.image_mean) == (1024, 64, [0.1, 0.2, 0.3])
    assert proc.transparent_bg_config == {"pattern": "white"}
    assert proc.get_number_of_image_tokens(2000, 2000) == spec_grid(2000, 2000, 1024, 64)[2]
