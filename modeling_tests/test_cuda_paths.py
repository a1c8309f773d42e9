"""What a GPU would run, exercised on CPU (issue 30): the attention implementation switched by config (the
flash-attention family gets transformers' 2-D padding mask, which the absorbed decode path must read right), and
the chunk-after-cache path when the model and the MLA layer decide it on different devices."""

import pytest
import torch

import transformers_k3.layers.mla as mla
from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig

from conftest import randomize_


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = KimiK3TextConfig.tiny()
    config.logit_scale = 0.5
    return randomize_(KimiK3ForCausalLM(config)).eval()


@pytest.fixture
def implementation(model):
    """Sets ``config._attn_implementation`` for a test and restores it."""
    before = model.config._attn_implementation

    def use(name):
        model.config._attn_implementation = name

    yield use
    model.config._attn_implementation = before


# flash_attention_2 / 3 run on CPU here as far as MLA goes: a decode step of <= 16 tokens after a cache takes the
# absorbed path, which never calls flash-attn; transformers then hands the layers its 2-D [B, S] padding mask
@pytest.mark.parametrize("attention", ["flash_attention_2", "flash_attention_3", "eager", "sdpa"])
@pytest.mark.parametrize("new_tokens", [1, 2, 3, 16])
def test_padded_decode_equals_the_unpadded_rows(model, implementation, attention, new_tokens):
    gen = torch.Generator().manual_seed(new_tokens)
    ids = torch.randint(3, 400, (2, 6), generator=gen)
    new = torch.randint(3, 400, (2, new_tokens), generator=gen)
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        implementation("sdpa")
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        alone = [model(torch.cat([ids[:1], new[:1]], 1)).logits[:, -new_tokens:],
                 model(torch.cat([ids[1:, 2:], new[1:]], 1)).logits[:, -new_tokens:]]
        implementation(attention)
        step = model(new, attention_mask=torch.cat([mask, torch.ones(2, new_tokens, dtype=torch.long)], 1),
                     past_key_values=cache).logits
    torch.testing.assert_close(step[:1], alone[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(step[1:], alone[1], atol=2e-5, rtol=1e-5)


def test_the_2d_padding_mask_is_causal_aligned_to_the_end():
    scores = torch.zeros(2, 1, 3, 5)
    out = mla._apply_mask(scores, torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]))
    kept = out > torch.finfo(out.dtype).min
    assert kept[0, 0].tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]
    assert kept[1, 0].tolist() == [[False, True, True, False, False], [False, True, True, True, False],
                                   [False] + [True] * 4]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("layer_takes_blockwise", [True, False])
def test_a_chunk_after_the_cache_agrees_whatever_device_each_module_sees(model, implementation, monkeypatch,
                                                                         attention, layer_takes_blockwise):
    """The model drops the [T, context] mask when it expects the layers' blockwise path (CPU SDPA); a layer on a
    GPU (here: told it is not on CPU) does not take that path and must still attend causally to the cache's end."""
    implementation(attention)
    ids = torch.randint(3, 400, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        if not layer_takes_blockwise:
            monkeypatch.setattr(mla, "uses_blockwise_attention", lambda config, hidden: False)
        cache = model(ids[:, :6], use_cache=True).past_key_values
        chunk = model(ids[:, 6:], past_key_values=cache).logits  # 24 tokens: more than the absorbed path takes
    torch.testing.assert_close(chunk, full[:, 6:], atol=2e-5, rtol=1e-5)


def test_moe_on_a_non_cpu_device_never_builds_the_cpu_kernels(monkeypatch):
    """The MoE layer asked the CPU kernel library for its decode limits before looking at the device: the first
    no-grad MoE step on CUDA compiled it (~15 s, needing g++). Meta tensors stand in for the GPU's."""
    from transformers_k3.layers.moe import KimiK3SparseMoE
    from transformers_k3.ops import cpu_kernel

    def built(*args, **kwargs):
        raise AssertionError("the CPU kernel library was asked for on a non-CPU device")

    monkeypatch.setattr(cpu_kernel, "library", built)
    monkeypatch.setattr(cpu_kernel, "moe_decode_max_tokens", built)
    config = KimiK3TextConfig.tiny()
    for dtype in (torch.float32, torch.bfloat16):  # (fp32: off the CPU the grouped GEMM kernel takes bf16 only)
        with torch.device("meta"):
            model = KimiK3ForCausalLM(config).to(dtype).eval()
        layers = [m for m in model.modules() if isinstance(m, KimiK3SparseMoE)]
        with torch.no_grad():
            for tokens in (1, 2, 40, 300):
                out = layers[0](torch.zeros(1, tokens, config.hidden_size, device="meta", dtype=dtype))
                assert out.shape == (1, tokens, config.hidden_size) and out.device.type == "meta"


def test_kda_on_cuda_without_fla_says_so_once(monkeypatch, caplog):
    from transformers_k3.ops import kda

    monkeypatch.setattr(kda, "_load_fla", lambda: (None, "ModuleNotFoundError: No module named 'fla'"))
    kda._warn_no_fla.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=kda.__name__):
            assert [kda._select_backend(None, torch.device("cuda")) for _ in range(3)] == ["torch"] * 3
            assert kda._select_backend(None, torch.device("cpu")) == "torch"
        warnings = [r.getMessage() for r in caplog.records if "flash-linear-attention" in r.getMessage()]
        assert len(warnings) == 1 and "pip install 'transformers-k3[fla]'" in warnings[0]
        assert "No module named 'fla'" in warnings[0]
    finally:
        kda._warn_no_fla.cache_clear()


def test_forced_fla_on_cpu_tensors_only_under_the_triton_interpreter(monkeypatch):
    from transformers_k3.ops import kda

    monkeypatch.setattr(kda, "_load_fla", lambda: ((object(), object()), None))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        kda._select_backend("fla", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kda._select_backend("fla", torch.device("cpu")) == "fla"
    assert kda._select_backend(None, torch.device("cpu")) == "torch"  # automatic choice: never Triton on CPU
