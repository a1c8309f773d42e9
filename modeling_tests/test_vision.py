"""The K3 vision tower, projector and `KimiK3ForConditionalGeneration`: official weight names, the tower against an
independent implementation of spec 7.1-7.4, block-diagonal attention, generation with images and video, mixed
batches, clear errors, Auto classes and the image-text-to-text pipeline."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, pipeline

from transformers_k3 import (
    KimiK3Config,
    KimiK3ForCausalLM,
    KimiK3ForConditionalGeneration,
    KimiK3VisionConfig,
)
from transformers_k3.modeling_kimi_k3_vl import (
    KimiK3MultiModalProjector,
    KimiK3VisionInputError,
    KimiK3VisionTower,
    apply_rope_2d,
    merge_sd2_tpool,
    rope_2d_angles,
)
from transformers_k3.configuration_kimi_k3 import KimiK3ConfigError
from transformers_k3.cache import KimiK3CacheError
from transformers_k3.modeling_kimi_k3_vl import KimiK3PlaceholderMismatchError

from references import randomize_

Image = pytest.importorskip("PIL.Image")
PAD_ID = 500
VIDEO = "<|kimi_video_placeholder|>"


def rgb(width, height, seed=0):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def frames(n, width, height, seed=0):
    return np.random.RandomState(seed).randint(0, 256, (n, height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return randomize_(KimiK3ForConditionalGeneration(KimiK3Config.tiny()).eval(), std=0.1)


def greedy(model, inputs, n):
    return model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)


# ---------------------------------------------------------------- names and shapes
def test_full_size_weight_names_and_shapes_match_the_checkpoint():
    """Spec 7.5: the official names and default shapes, so vision_tower.* / mm_projector.* load 1:1."""
    vision = KimiK3VisionConfig(text_hidden_size=7168)
    with torch.device("meta"):
        tower, projector = KimiK3VisionTower(vision), KimiK3MultiModalProjector(vision)
    shapes = {f"vision_tower.{k}": tuple(v.shape) for k, v in tower.state_dict().items()}
    shapes.update({f"mm_projector.{k}": tuple(v.shape) for k, v in projector.state_dict().items()})
    expected = {
        "vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
        "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
        "vision_tower.encoder.final_layernorm.weight": (1024,),
        "mm_projector.proj.0.weight": (4096, 4096),
        "mm_projector.proj.2.weight": (7168, 4096),
        "mm_projector.post_norm.weight": (7168,),
    }
    for j in range(27):
        expected.update({
            f"vision_tower.encoder.blocks.{j}.norm0.weight": (1024,),
            f"vision_tower.encoder.blocks.{j}.norm1.weight": (1024,),
            f"vision_tower.encoder.blocks.{j}.wqkv.weight": (4608, 1024),
            f"vision_tower.encoder.blocks.{j}.wo.weight": (1024, 1536),
            f"vision_tower.encoder.blocks.{j}.mlp.fc0.weight": (4096, 1024),
            f"vision_tower.encoder.blocks.{j}.mlp.fc1.weight": (1024, 4096),
        })
    assert shapes == expected  # the time table is a non-persistent buffer, not a checkpoint tensor


def test_composite_state_dict_prefixes(model):
    prefixes = {k.split(".")[0] for k in model.state_dict()}
    assert prefixes == {"vision_tower", "mm_projector", "language_model"}
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in model.state_dict()
    assert "language_model.lm_head.weight" in model.state_dict()


def test_tower_and_projector_shapes(model):
    grids = torch.tensor([[1, 4, 6], [3, 2, 2], [1, 10, 2]])
    pixels = torch.randn(int(grids.prod(-1).sum()), 3, 14, 14)
    with torch.no_grad():
        merged = model.vision_tower(pixels, grids)
        embeds = model.get_image_features(pixels, grids)
    assert merged.shape == (6 + 1 + 5, 4, 32)  # (h/2)(w/2) per item, independent of t
    assert [e.shape for e in embeds] == [(6, 64), (1, 64), (5, 64)]


# ---------------------------------------------------------------- the tower against an independent reference
def test_rope_matches_the_complex_formula():
    """Spec 7.2: pairs (2m, 2m+1) as complex numbers times [e^{ix f0}, e^{iy f0}, e^{ix f1}, ...]."""
    h, w, d = 3, 5, 16
    x = torch.randn(h * w, 2, d)
    angles = rope_2d_angles(h, w, d)
    got = apply_rope_2d(x, angles.cos(), angles.sin())
    f = [10000 ** (-4 * i / d) for i in range(d // 4)]
    want = torch.empty_like(x)
    for row in range(h):
        for col in range(w):
            rot = []
            for fi in f:
                rot += [complex(math.cos(col * fi), math.sin(col * fi)),
                        complex(math.cos(row * fi), math.sin(row * fi))]
            rot = torch.tensor(rot, dtype=torch.complex64)
            z = torch.view_as_complex(x[row * w + col].reshape(2, d // 2, 2).contiguous()) * rot
            want[row * w + col] = torch.view_as_real(z).reshape(2, d)
    torch.testing.assert_close(got, want)


def reference_tower(tower, pixel_values, grids):
    """Spec 7.1-7.3 written out directly: the conv as a linear map, explicit bilinear table, sin/cos time table,
    complex RoPE, per-item attention with an explicit softmax, RMSNorm with fp32 epsilon."""
    cfg = tower.config
    dim, heads = cfg.vt_hidden_size, cfg.vt_num_attention_heads
    hd = cfg.qkv_hidden_size // heads
    eps = torch.finfo(torch.float32).eps

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    x_all = pixel_values.flatten(1) @ tower.patch_embed.proj.weight.flatten(1).T
    table = tower.patch_embed.pos_emb.weight
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float32) / (dim // 2))
    freqs = [10000 ** (-4 * i / hd) for i in range(hd // 4)]
    outputs, start = [], 0
    for t, h, w in grids:
        x = x_all[start:start + t * h * w]
        start += t * h * w
        pos2d = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear",
                              align_corners=False)[0].permute(1, 2, 0).reshape(h * w, dim)
        if t == 1:
            pos = pos2d
        else:
            pos = torch.cat([pos2d + torch.cat([torch.sin(f * omega), torch.cos(f * omega)]) for f in range(t)])
        x = x + pos
        rot = torch.tensor([[complex(math.cos(c * fi), math.sin(c * fi)) if k == 0 else
                             complex(math.cos(r * fi), math.sin(r * fi)) for fi in freqs for k in (0, 1)]
                            for r in range(h) for c in range(w)], dtype=torch.complex64).repeat(t, 1)
        for block in tower.encoder.blocks:
            qkv = (rms(x, block.norm0.weight) @ block.wqkv.weight.T).view(-1, 3, heads, hd)
            q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
            q = torch.view_as_real(torch.view_as_complex(q.reshape(-1, heads, hd // 2, 2).contiguous())
                                   * rot[:, None]).reshape(-1, heads, hd)
            k = torch.view_as_real(torch.view_as_complex(k.reshape(-1, heads, hd // 2, 2).contiguous())
                                   * rot[:, None]).reshape(-1, heads, hd)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(-1, heads * hd)
            x = x + attn @ block.wo.weight.T
            hidden = F.gelu(rms(x, block.norm1.weight) @ block.mlp.fc0.weight.T, approximate="tanh")
            x = x + hidden @ block.mlp.fc1.weight.T
        x = rms(x, tower.encoder.final_layernorm.weight)
        x = x.view(t, h // 2, 2, w // 2, 2, dim).permute(0, 1, 3, 2, 4, 5).mean(0)
        outputs.append(x.reshape(-1, 4, dim))
    return torch.cat(outputs)


def test_tower_matches_an_independent_implementation_of_the_spec(model):
    grids = [(1, 8, 8), (1, 4, 6), (3, 2, 4), (4, 6, 2), (1, 2, 2)]  # exact table size, resized, video chunks
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14)
    with torch.no_grad():
        got = model.vision_tower(pixels, torch.tensor(grids))
        want = reference_tower(model.vision_tower, pixels, grids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_position_table_and_time_embedding(model):
    pos_emb = model.vision_tower.patch_embed.pos_emb
    table = pos_emb.weight.detach()
    with torch.no_grad():
        torch.testing.assert_close(pos_emb([(1, 8, 8)]), table.reshape(64, -1))
        # halving the 8x8 table bilinearly (align_corners=False, no antialias) averages each 2x2 block
        halved = table.reshape(4, 2, 4, 2, -1).mean((1, 3)).reshape(16, -1)
        torch.testing.assert_close(pos_emb([(1, 4, 4)]), halved)
        # t = 1: no time embedding at all; t > 1: frame f gets [sin(f w), cos(f w)] (frame 0 included)
        video = pos_emb([(3, 4, 4)]).reshape(3, 16, -1)
        omega = 1.0 / 10000 ** (torch.arange(16) / 16.0)
        for f in range(3):
            torch.testing.assert_close(video[f], halved + torch.cat([torch.sin(f * omega), torch.cos(f * omega)]))
    assert not torch.equal(video[0], pos_emb([(1, 4, 4)]))


def test_merge_window_order_and_temporal_mean():
    x = torch.arange(2 * 2 * 4, dtype=torch.float32).reshape(-1, 1)  # t=2, h=2, w=4, one channel
    merged = merge_sd2_tpool(x, [(2, 2, 4)], (2, 2))
    frame0 = torch.tensor([[[0.], [1.], [4.], [5.]], [[2.], [3.], [6.], [7.]]])
    torch.testing.assert_close(merged, frame0 + 4.0)  # mean of frame 0 and frame 1 (= frame 0 + 8)
    single = merge_sd2_tpool(x[:8], [(1, 2, 4)], (2, 2))
    torch.testing.assert_close(single, frame0)


def test_image_features_do_not_depend_on_the_other_items(model):
    """Block-diagonal attention, and no time embedding for t=1 (spec 11.1.13)."""
    alone_grid = [(1, 4, 6)]
    others = [(1, 2, 2), (3, 4, 4), (1, 6, 2)]
    pixels = {g: torch.randn(g[0] * g[1] * g[2], 3, 14, 14) for g in alone_grid + others}
    with torch.no_grad():
        alone = model.get_image_features(pixels[alone_grid[0]], torch.tensor(alone_grid))[0]
        order = [others[0], alone_grid[0], others[1], others[2]]
        together = model.get_image_features(torch.cat([pixels[g] for g in order]), torch.tensor(order))[1]
    torch.testing.assert_close(alone, together, rtol=1e-5, atol=1e-5)


def test_projector_output_has_unit_rms_with_unit_norm_weight():
    vision = KimiK3Config.tiny().vision_config
    projector = KimiK3MultiModalProjector(vision)
    with torch.no_grad():
        projector.post_norm.weight.fill_(1.0)
        out = projector(torch.randn(7, 4, 32))
    torch.testing.assert_close(out.pow(2).mean(-1).sqrt(), torch.ones(7), rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- generation
def ask_about_an_image(processor, question):
    """A chat prompt (generation stub included) with one 70x50 image and ``question``, as model inputs."""
    messages = [{"role": "user", "content": [{"type": "image", "image": rgb(70, 50)},
                                             {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")


def test_generate_with_an_image_equals_recomputing_without_cache(model, processor):
    inputs = ask_about_an_image(processor, "What is it?")
    with torch.no_grad():
        out = greedy(model, inputs, 5)
        ids = inputs["input_ids"]
        for _ in range(5):  # pixels on every step, no cache
            types = F.pad(inputs["mm_token_type_ids"], (0, ids.shape[1] - inputs["input_ids"].shape[1]))
            logits = model(input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                           mm_token_type_ids=types, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    assert torch.equal(out, ids)


def _second_turn(model, processor):
    """A first turn with image A generated with a cache, then the whole conversation: the first turn's sequence and a
    new part holding image B. Returns (first output, whole ids, the new part's processor output)."""
    first = ask_about_an_image(processor, "What is it?")
    out = model.generate(**first, max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0,
                         return_dict_in_generate=True)
    new = processor(text="<|kimi_image_placeholder|> and this?", images=[rgb(40, 60, 2)], return_tensors="pt")
    ids = torch.cat([out.sequences, new["input_ids"]], dim=1)
    return first, out, ids, new


def test_continuing_a_conversation_with_images_from_its_cache_equals_a_fresh_run(model, processor):
    """Turn two of a conversation from turn one's cache, given the media of the whole conversation (as the processor
    returns them for it) or only the new turn's, gives the tokens of a fresh run over the whole conversation (the
    held image's features were counted against the new part's slots: a mismatch error either way)."""
    with torch.no_grad():
        first, out, ids, new = _second_turn(model, processor)
        types = torch.cat([F.pad(first["mm_token_type_ids"], (0, out.sequences.shape[1] - first["input_ids"].shape[1])),
                           new["mm_token_type_ids"]], dim=1)
        whole = dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                     pixel_values=torch.cat([first["pixel_values"], new["pixel_values"]]),
                     image_grid_thw=torch.cat([first["image_grid_thw"], new["image_grid_thw"]]))
        fresh = greedy(model, whole, 4)
        assert torch.equal(model.generate(**whole, past_key_values=copy.deepcopy(out.past_key_values),
                                          max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0), fresh)
        only_new = dict(whole, pixel_values=new["pixel_values"], image_grid_thw=new["image_grid_thw"])
        assert torch.equal(model.generate(**only_new, past_key_values=copy.deepcopy(out.past_key_values),
                                          max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0), fresh)


def test_continuing_a_cache_with_other_pixels_for_its_images_is_refused(model, processor):
    """The cache's token ids cannot tell two images of one size apart (the same `<|media_pad|>` run): given other
    pixels for the image it holds, continuing is a KimiK3CacheError, not an answer about another image."""
    with torch.no_grad():
        first, out, ids, new = _second_turn(model, processor)
        other = ask_about_an_image(processor, "What is it?")
        other["pixel_values"] = other["pixel_values"].flip(0)
        types = torch.cat([F.pad(first["mm_token_type_ids"], (0, out.sequences.shape[1] - first["input_ids"].shape[1])),
                           new["mm_token_type_ids"]], dim=1)
        with pytest.raises(KimiK3CacheError, match="other images or videos"):
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                           pixel_values=torch.cat([other["pixel_values"], new["pixel_values"]]),
                           image_grid_thw=torch.cat([first["image_grid_thw"], new["image_grid_thw"]]),
                           past_key_values=copy.deepcopy(out.past_key_values), max_new_tokens=2, do_sample=False,
                           eos_token_id=None, pad_token_id=0)


def test_assisted_and_prompt_lookup_decoding_with_an_image_equal_greedy(model, processor):
    """The multimodal model allows the generation modes the text model does (its hybrid cache crops KDA states):
    prompt-lookup decoding with an image in the prompt (its first call appends draft tokens to the prompt, past the
    processor's mm_token_type_ids) and assisted decoding (the model as its own draft) on text give the greedy
    tokens."""
    inputs = ask_about_an_image(processor, "What is it? What is it?")
    with torch.no_grad():
        want = greedy(model, inputs, 8)
        assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                          pad_token_id=0, prompt_lookup_num_tokens=3), want)
        text = processor(text="What is it? What is it? What", return_tensors="pt")
        assert torch.equal(model.generate(**text, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                          pad_token_id=0, assistant_model=model), greedy(model, text, 8))
        with pytest.raises(ValueError, match="mm_token_type_ids"):
            model(**{**inputs, "mm_token_type_ids": F.pad(inputs["mm_token_type_ids"], (0, 2))})


def test_from_pretrained_routes_text_fields_to_the_text_config(model, tmp_path):
    """``from_pretrained(dir, output_router_logits=True, ...)`` on the multimodal model sets those text-model fields
    (the composite config has none of them), as on the text model; a bad value is a config error naming it."""
    model.save_pretrained(tmp_path)
    loaded = KimiK3ForConditionalGeneration.from_pretrained(tmp_path, output_router_logits=True,
                                                            router_aux_loss_coef=0.01)
    assert loaded.config.text_config.output_router_logits and loaded.config.text_config.router_aux_loss_coef == 0.01
    ids = torch.tensor([[5, 6, 7, 8]])
    out = loaded(ids, labels=ids)
    assert out.router_logits is not None and out.aux_loss is not None
    with pytest.raises(KimiK3ConfigError, match="`rms_norm_eps`"):
        KimiK3ForConditionalGeneration.from_pretrained(tmp_path, rms_norm_eps=-1.0)


def test_generate_with_a_video(model, processor):
    inputs = processor(text=f"Watch {VIDEO} now", videos=[frames(6, 40, 30)], return_tensors="pt")
    assert inputs["video_grid_thw"].tolist() == [[4, 4, 4], [2, 4, 4]]  # t > 1 chunks
    with torch.no_grad():
        out = greedy(model, inputs, 4)
        features = model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    assert out.shape == (1, inputs["input_ids"].shape[1] + 4)
    assert [f.shape[0] for f in features] == [4, 4]


def test_mixed_batch_equals_each_sample_alone(model, processor):
    """Several images of different sizes, an image + a video (chunks of t=4 and t=1), and a text-only row."""
    samples = [
        dict(text=f"two {'<|media_pad|>'} and {'<|media_pad|>'}.", images=[rgb(56, 28, 1), rgb(30, 60, 2)]),
        dict(text=f"{VIDEO} vs <|media_pad|>", images=[rgb(28, 28, 3)], videos=[frames(5, 28, 56, 4)]),
        dict(text="just some text here"),
    ]
    batch = processor(text=[s["text"] for s in samples],
                      images=[im for s in samples for im in s.get("images", [])],
                      videos=[v for s in samples for v in s.get("videos", [])], padding=True, return_tensors="pt")
    assert sorted({t for t, _, _ in batch["video_grid_thw"].tolist()}) == [1, 4]
    with torch.no_grad():
        batched_logits = model(**batch).logits[:, -1]
        batched_out = greedy(model, batch, 4)[:, -4:]
        for i, sample in enumerate(samples):
            single = processor(**sample, return_tensors="pt")
            logits = model(**single).logits[:, -1]
            scale = logits.abs().max()
            assert ((batched_logits[i] - logits[0]).abs().max() / scale).item() < 1e-5
            assert torch.equal(batched_out[i], greedy(model, single, 4)[0, -4:])


# ---------------------------------------------------------------- errors
def test_placeholder_mismatch_names_both_numbers(model, processor):
    inputs = processor(text="<|media_pad|>", images=[rgb(56, 56)], return_tensors="pt")  # 4 slots
    ids = inputs["input_ids"][:, :-2]  # drop one pad (and <|media_end|>): 3 slots left
    with pytest.raises(KimiK3PlaceholderMismatchError, match="3 image slots .* produce 4 features"):
        model(input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    with pytest.raises(KimiK3PlaceholderMismatchError, match="4 media placeholder tokens .* no pixel_values"):
        model(input_ids=inputs["input_ids"])


def test_images_and_videos_together_need_token_types(model, processor):
    inputs = processor(text=f"{VIDEO}<|media_pad|>", images=[rgb(28, 28)], videos=[frames(2, 28, 28)],
                       return_tensors="pt")
    inputs.pop("mm_token_type_ids")
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        model(**inputs)


def test_tower_rejects_bad_grids_naming_the_limit(model):
    with pytest.raises(KimiK3VisionInputError, match="at most 512x512"):
        model.vision_tower(torch.zeros(514 * 2, 3, 14, 14), torch.tensor([[1, 514, 2]]))
    with pytest.raises(KimiK3VisionInputError, match="t=5 frames; the tower takes 1..4"):
        model.vision_tower(torch.zeros(5 * 4, 3, 14, 14), torch.tensor([[5, 2, 2]]))
    with pytest.raises(KimiK3VisionInputError, match="multiples of the merge kernel"):
        model.vision_tower(torch.zeros(6, 3, 14, 14), torch.tensor([[1, 2, 3]]))


# ---------------------------------------------------------------- Auto classes, pipeline, text-only loading
def test_save_reload_pipeline_and_text_only_loading(tmp_path, model, processor):
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    assert isinstance(reloaded, KimiK3ForConditionalGeneration)
    inputs = processor(text="<|media_pad|> hi", images=[rgb(40, 40)], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, model(**inputs).logits)

    pipe = pipeline("image-text-to-text", model=str(tmp_path))
    messages = [{"role": "user", "content": [{"type": "image", "image": rgb(60, 45)},
                                             {"type": "text", "text": "Describe."}]}]
    result = pipe(text=messages, max_new_tokens=3, generate_kwargs={"do_sample": False})
    assert result[0]["generated_text"][-1]["role"] == "assistant"

    # The same directory, text only: weights come from language_model.*, vision weights are skipped.
    text_model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(text_model, KimiK3ForCausalLM)
    ids = torch.randint(3, 400, (2, 9))
    with torch.no_grad():
        assert torch.equal(text_model(ids).logits, model(input_ids=ids).logits)
