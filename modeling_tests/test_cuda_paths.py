"""What a GPU would run, exercised on CPU (issue 30): no CPU kernel build off the CPU, fla's kernels asked for
what they take, the cache's state following each layer's device without copies at every step. (MLA's GPU paths,
the flash-attention masks and CUDA's log-sum-exp kernel, are in test_mla.py.)"""

import types

import pytest
import torch

from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig

from references import randomize_


_MOE_ON_META = """
import sys, torch
from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig, kernelize
from transformers_k3.modeling_kimi_k3 import KimiK3SparseMoE
config = KimiK3TextConfig.tiny()
for dtype in (torch.float32, torch.bfloat16):  # (fp32: off the CPU the grouped GEMM kernel takes bf16 only)
    with torch.device("meta"):
        model = kernelize(KimiK3ForCausalLM(config).to(dtype).eval())
    layer = next(m for m in model.modules() if isinstance(m, KimiK3SparseMoE))
    with torch.no_grad():
        for tokens in (1, 2, 40, 300):
            out = layer(torch.zeros(1, tokens, config.hidden_size, device="meta", dtype=dtype))
            assert out.shape == (1, tokens, config.hidden_size) and out.device.type == "meta"
print("ON META", flush=True)
if sys.argv[1] == "then-on-cpu":  # the control: a CPU decode step builds them
    with torch.no_grad():
        kernelize(KimiK3ForCausalLM(config).eval())(torch.tensor([[3, 4]]))
"""


@pytest.mark.parametrize("then_on_cpu", [False, True])
def test_moe_on_a_non_cpu_device_never_builds_the_cpu_kernels(tmp_path, then_on_cpu):
    """The kernelized MoE layer asked the CPU kernel library for its decode limits before looking at the device: the
    first no-grad MoE step on CUDA compiled it (needing g++). Meta tensors stand in for the GPU's, in a fresh process
    with an empty kernel cache and a compiler that leaves a mark when run; the control, a CPU step, runs it."""
    import os
    import subprocess
    import sys

    mark = tmp_path / "compiler-ran"
    compiler = tmp_path / "cxx"
    compiler.write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    compiler.chmod(0o755)
    env = {**os.environ, "CXX": str(compiler), "TRANSFORMERS_K3_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", _MOE_ON_META, "then-on-cpu" if then_on_cpu else "meta"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and "ON META" in result.stdout, result.stderr[-3000:]
    assert mark.exists() == then_on_cpu, result.stderr[-3000:]


def _state_devices(cache):
    """Layer index -> the set of device types its cached tensors are on."""
    devices = {}
    for idx, layer in enumerate(cache.layers):
        tensors = [layer.latent] if hasattr(layer, "latent") else [layer.conv_state, layer.recurrent_state]
        devices[idx] = {t.device.type for t in tensors}
    return devices


@pytest.fixture
def saved_cache(tmp_path):
    from transformers_k3 import KimiK3HybridCache

    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny())).eval()
    with torch.no_grad():
        cache = model(torch.randint(3, 400, (2, 5), generator=torch.Generator().manual_seed(1)),
                      use_cache=True).past_key_values
    assert isinstance(cache, KimiK3HybridCache)
    path = tmp_path / "cache.safetensors"
    cache.save(path, model=model)
    return model, path


def test_a_loaded_cache_follows_each_layer_of_the_model(saved_cache):
    """Under a device_map each layer's state must sit where that layer computes (meta stands in for a second
    device): a GPU model failed its first step on a cache loaded to the CPU."""
    from transformers_k3 import KimiK3HybridCache

    model, path = saved_cache
    elsewhere = {1, 2}  # a KDA and an MLA layer
    for idx in elsewhere:
        model.model.layers[idx].to("meta")
    with pytest.warns(UserWarning, match="cannot be read cheaply"):  # (meta weights: no fingerprint to check)
        cache = KimiK3HybridCache.load(path, model.config, model=model)
    assert _state_devices(cache) == {idx: {"meta" if idx in elsewhere else "cpu"} for idx in range(6)}
    assert cache.token_ids.device.type == "cpu"  # with the embedding


def test_a_loaded_cache_follows_an_offloaded_layers_execution_device(saved_cache):
    """accelerate's offload keeps a layer's weights on the CPU (or meta) and computes on its hook's device."""
    import types

    from transformers_k3 import KimiK3HybridCache

    model, path = saved_cache
    model.model.layers[3]._hf_hook = types.SimpleNamespace(execution_device=torch.device("meta"))
    model.model.layers[5]._hf_hook = types.SimpleNamespace(hooks=[types.SimpleNamespace(execution_device="meta")])
    cache = KimiK3HybridCache.load(path, model.config, model=model)
    assert _state_devices(cache) == {idx: {"meta" if idx in (3, 5) else "cpu"} for idx in range(6)}


def test_an_explicit_device_wins_over_the_models(saved_cache):
    from transformers_k3 import KimiK3HybridCache

    model, path = saved_cache
    model.model.layers[1].to("meta")
    with pytest.warns(UserWarning, match="cannot be read cheaply"):
        cache = KimiK3HybridCache.load(path, model.config, model=model, device="cpu")
    assert _state_devices(cache) == {idx: {"cpu"} for idx in range(6)}


class _CrossDeviceCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts copies between devices (``.to(device)``, ``copy_`` from another device)."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and tensors:
            source = tensors[-1] if func is torch.ops.aten.copy_.default else tensors[0]
            target = out if isinstance(out, torch.Tensor) else tensors[0]
            if source.device != target.device:
                self.copies.append((tuple(source.shape), source.device.type, target.device.type))
        return out


@pytest.mark.parametrize("preallocated", [True, False])
def test_a_cache_built_without_a_device_keeps_the_latents_with_the_activations(preallocated):
    """`KimiK3HybridCache(config, batch_size=B)` reserved its latents on the CPU and every step of a GPU model copied
    each MLA layer's whole latent to the GPU; now the reservation moves to the activations' device (meta here), once."""
    from transformers_k3 import KimiK3HybridCache

    config = KimiK3TextConfig.tiny()
    width = config.kv_lora_rank + config.qk_rope_head_dim
    cache = KimiK3HybridCache(config, batch_size=2 if preallocated else None)
    mla_layer = config.layer_types.index("full_attention")
    with _CrossDeviceCopies() as counter:
        for step in range(4):
            view = cache.update_mla(torch.zeros(2, 5 if step == 0 else 1, width, device="meta"), mla_layer)
            assert view.latent.device.type == "meta" and view.latent.shape[1] == 5 + step
            assert view.past_len == (0 if step == 0 else 4 + step)
    assert counter.copies == []
    assert cache.layers[mla_layer].latent.device.type == "meta"


def test_a_cache_on_the_cpu_moves_to_the_model_once(saved_cache):
    """A cache loaded without a model (so to the CPU) serves a model elsewhere (meta here): each layer's state moves
    to its activations at the first step, not at every step."""
    from transformers_k3 import KimiK3HybridCache

    model, path = saved_cache
    cache = KimiK3HybridCache.load(path, model.config)
    assert _state_devices(cache) == {idx: {"cpu"} for idx in range(6)}
    config = model.config
    layers = [model.model.layers[i] for i in range(6)]
    kda = layers[0].self_attn.to("meta")
    width = config.kv_lora_rank + config.qk_rope_head_dim
    with torch.no_grad(), _CrossDeviceCopies() as counter:
        for step in range(3):
            kda(torch.zeros(2, 1, config.hidden_size, device="meta"), past_key_values=cache)
            cache.update_mla(torch.zeros(2, 1, width, device="meta"), 2)
    moved = [c for c in counter.copies if c[1:] == ("cpu", "meta")]
    assert len(moved) == 3  # conv window, recurrent state, latent: each once
    assert _state_devices(cache)[0] == {"meta"} and _state_devices(cache)[2] == {"meta"}


def test_a_half_precision_router_off_the_cpu_makes_no_fp32_copy_of_its_weight():
    """The router upcast its whole [E, H] weight to fp32 at every call off the CPU (twice the weight's bytes moved
    per layer per step); the fp32 logits come from the bf16 operands with fp32 accumulation instead. Meta tensors
    stand in for CUDA's (the numbers are a GPU check: bench/gpu_check.sh)."""
    from transformers_k3.modeling_kimi_k3 import KimiK3Router

    class Casts(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                self.shapes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    config = KimiK3TextConfig.tiny()
    with torch.device("meta"):
        router = KimiK3Router(config).to(torch.bfloat16)
    with torch.no_grad(), Casts() as casts:
        logits, weights, indices = router(torch.zeros(3, config.hidden_size, dtype=torch.bfloat16, device="meta"))
    assert logits.dtype == torch.float32 and tuple(logits.shape) == (3, config.num_experts)
    assert tuple(router.weight.shape) not in casts.shapes


def test_decode_steps_read_the_stacked_conv_filter_and_see_every_change(model):
    """The three short-convolution filters are one stacked parameter (stacked when loading): a decode step
    concatenates no filters and follows a filter changed in place (an optimizer step, load_state_dict, a write through
    ``.data``) or replaced. Reference: the whole sequence run without a cache, after each change."""
    from transformers_k3.modeling_kimi_k3 import KimiK3DeltaAttention

    layers = [m for m in model.modules() if isinstance(m, KimiK3DeltaAttention)]
    layer = layers[0]
    proj, width = layer.proj_dim, 3 * layer.proj_dim

    class FilterCats(torch.utils._python_dispatch.TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.cat.default and tuple(out.shape) == (width, layer.conv_size):
                FilterCats.count += 1
            return out

    ids = torch.randint(3, 400, (1, 9), generator=torch.Generator().manual_seed(5))
    original = layer.conv1d.weight

    def decoded():
        cache = model(ids[:, :6], use_cache=True).past_key_values
        return torch.cat([model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(6, 9)], 1)

    try:
        with torch.no_grad():
            layer.conv1d.weight = torch.nn.Parameter(original.detach().clone())
            with FilterCats():
                steps = decoded()
            assert FilterCats.count == 0  # three decode steps, no concatenation of the filters
            torch.testing.assert_close(steps, model(ids).logits[:, 6:], atol=2e-5, rtol=1e-5)
            layer.conv1d.weight[:proj].mul_(-1.5)  # q's, in place, as an optimizer step or load_state_dict writes
            torch.testing.assert_close(decoded(), model(ids).logits[:, 6:], atol=2e-5, rtol=1e-5)
            replaced = layer.conv1d.weight.detach().clone()
            replaced[proj:2 * proj] *= 0.5
            layer.conv1d.weight = torch.nn.Parameter(replaced)  # k's, replaced
            torch.testing.assert_close(decoded(), model(ids).logits[:, 6:], atol=2e-5, rtol=1e-5)
            # cast there and back (module._apply replaces each parameter's data), changed in between
            model.double()
            layer.conv1d.weight.data[2 * proj:].mul_(0.5)
            model.float()
            torch.testing.assert_close(decoded(), model(ids).logits[:, 6:], atol=2e-5, rtol=1e-5)
            layer.conv1d.weight.data[2 * proj:].mul_(3.0)  # v's, through .data without a cast
            torch.testing.assert_close(decoded(), model(ids).logits[:, 6:], atol=2e-5, rtol=1e-5)
    finally:
        layer.conv1d.weight = original


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_the_layer_asks_flas_chunked_kernel_for_its_bounded_gate_path(lower_bound):
    """K3's gate is ``lower_bound * sigmoid(.)``, inside (lower_bound, 0): with the bound in [-5, 0) the layer's
    prefill asks fla's chunk_kda for safe_gate (its faster path for bounded gates, which it never used); Kimi
    Linear's unbounded softplus gate does not. A stand-in for fla's kernels in the KDA layers' kernel slot (no Triton
    here) records the call's keywords."""
    from transformers_k3.modeling_kimi_k3 import KimiK3DeltaAttention

    seen = []

    def chunk(q, k, v, g, beta, initial_state=None, output_final_state=False, **kwargs):
        seen.append(kwargs.get("safe_gate", False))
        if lower_bound is not None:
            assert bool((g >= lower_bound).all() and (g <= 0).all())  # what safe_gate promises the kernel
        state = torch.zeros(q.shape[0], v.shape[2], q.shape[3], v.shape[3])
        return torch.zeros_like(v), state if output_final_state else None

    config = KimiK3TextConfig.tiny(linear_attn_config={"gate_lower_bound": lower_bound})
    model = KimiK3ForCausalLM(config).eval()
    for layer in model.modules():
        if isinstance(layer, KimiK3DeltaAttention):
            layer.kernel = (chunk, chunk)
    with torch.no_grad():
        model(torch.randint(3, 400, (1, 40)))
    assert seen and all(flag == (lower_bound is not None) for flag in seen), seen
