"""The static hybrid cache (`KimiK3HybridCache(static=True)`, ``generate(cache_implementation="static")``): fixed
shapes and addresses for compiled decode steps. Its steps are checked against a forward over the whole sequence with
no cache at all (teacher forcing), and against the growing cache's steps."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

from references import randomize_
from transformers_k3 import KimiK3Config, KimiK3ForCausalLM, KimiK3ForConditionalGeneration, KimiK3TextConfig
from transformers_k3.cache import KimiK3CacheError, KimiK3HybridCache, KimiK3StaticMLACacheLayer
from transformers_k3.ops import cpu_kernel


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

    model = model.to(dtype)
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
    original = KimiK3StaticMLACacheLayer.update

    def watch(layer, *args, **kwargs):
        out = original(layer, *args, **kwargs)
        if not torch.compiler.is_compiling():
            prefilled.setdefault(id(layer), layer.latent.data_ptr())
        return out

    try:
        with torch.no_grad():
            eager = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
            eager_static = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                          cache_implementation="static")
            torch._dynamo.reset()
            counters.clear()
            KimiK3StaticMLACacheLayer.update = watch
            out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                 cache_implementation="static", compile_config=compile_config,
                                 return_dict_in_generate=True)
    finally:
        KimiK3StaticMLACacheLayer.update = original
        model.to(torch.float32)
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
