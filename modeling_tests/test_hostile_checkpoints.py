"""Checkpoint files and configs crafted to pass every shape check yet load wrong or exhaust memory (issue 44): each
reader (`from_pretrained` direct and through the Auto class, the official converter with and without
``keep_quantized``, the exporter) refuses them with a named error, and size checks come before any allocation.

Fixtures: tiny official-layout checkpoints (bf16, and MXFP4 experts) built with `references`' helpers, and our
own layout written by ``save_pretrained``.
"""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig
from transformers_k3.configuration_kimi_k3 import KimiK3ConfigError
from transformers_k3.conversion import CheckpointError
from transformers_k3.convert import convert_official_checkpoint, export_to_official
from transformers_k3.conversion.quant import E2M1_VALUES, QuantFormatError, check_mxfp4_values, dequantize_mxfp4

from references import (
    _index,
    assert_converter_refuses,
    representable_tiny,
    shard_tensors_file,
    write_official_text,
)

Q = "model.layers.1.self_attn.q_proj.weight"
SCALE = "model.layers.3.block_sparse_moe.experts.2.w1.weight_scale"
PACKED = SCALE.replace("weight_scale", "weight_packed")


@pytest.fixture(scope="module")
def tiny_model():
    return representable_tiny()


@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory, tiny_model):
    path = tmp_path_factory.mktemp("ckpt") / "bf16"
    return write_official_text(path, tiny_model, quantized=False)


@pytest.fixture(scope="module")
def mxfp4_source(tmp_path_factory, tiny_model):
    path = tmp_path_factory.mktemp("ckpt") / "mxfp4"
    return write_official_text(path, tiny_model, quantized=True)


def _copy(source: Path, tmp_path: Path, name="ckpt") -> Path:
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def _edit_tensor(path: Path, name: str, edit):
    single = path / "model.safetensors"
    shard = single if single.is_file() else path / _index(path)[name]
    tensors = shard_tensors_file(shard)
    edit(tensors)
    save_file(tensors, str(shard))
    return shard


def _add_to_index(path: Path, name: str, shard: Path):
    data = json.loads((path / "model.safetensors.index.json").read_text())
    data["weight_map"][name] = shard.name
    (path / "model.safetensors.index.json").write_text(json.dumps(data))


def _edit_config(path: Path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def _loaders_refuse(path: Path, error=CheckpointError, *fragments, **kwargs) -> str:
    message = ""
    for loader in (KimiK3ForCausalLM, AutoModelForCausalLM):
        with pytest.raises(error) as raised:
            loader.from_pretrained(path, **kwargs)
        message = str(raised.value)
        for fragment in fragments:
            assert fragment in message, (fragment, message)
    return message


# --------------------------------------------------------------------------------------------------
# FP8 weights: never read unscaled
def test_fp8_weight_without_its_scale_is_refused_by_from_pretrained_as_by_the_converter(bf16_source, tmp_path):
    """The issue's case: an e4m3 weight holding 448 where 0.299 belongs (its scale is gone) loaded as 448."""
    path = _copy(bf16_source, tmp_path)
    _edit_tensor(path, Q, lambda t: t.__setitem__(Q, torch.full((64, 64), 448.0).to(torch.float8_e4m3fn)))
    fragments = (Q, "FP8 weight without a `weight_scale_inv`/`weight_scale` next to it")
    assert_converter_refuses(path, *fragments, script_too=False)
    _loaders_refuse(path, CheckpointError, *fragments)


def test_fp8_weight_with_its_scale_loads_through_the_converter_only(bf16_source, tmp_path):
    """transformers would read the e4m3 codes and ignore the scale: from_pretrained refuses and points to the
    converter, which applies the scale (0.25 * 448 = 112)."""
    path = _copy(bf16_source, tmp_path)

    def edit(tensors):
        tensors[Q] = torch.full((64, 64), 448.0).to(torch.float8_e4m3fn)
        tensors[Q + "_scale_inv"] = torch.tensor([[0.25]])

    _add_to_index(path, Q + "_scale_inv", _edit_tensor(path, Q, edit))
    _loaders_refuse(path, CheckpointError, Q, "read it unscaled", "convert_k3_official_to_hf.py")
    # a quantizer that never reads FP8 does not take it either
    _edit_config(path, lambda c: c.__setitem__("quantization_config",
                                               {"quant_method": "bitsandbytes", "load_in_4bit": True}))
    _loaders_refuse(path, CheckpointError, Q, "read it unscaled")
    _edit_config(path, lambda c: c.pop("quantization_config"))
    convert_official_checkpoint(path, tmp_path / "out", progress=False)
    model = KimiK3ForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(model.get_parameter(Q), torch.full((64, 64), 112.0, dtype=model.get_parameter(Q).dtype))


# --------------------------------------------------------------------------------------------------
# E8M0 scales that make weights infinite (254) or NaN (255)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_value_check_agrees_with_dequantising_in_float64(dtype):
    """Every (scale, code) pair: refused exactly when the weight it gives is not finite once cast to ``dtype``."""
    for scale in range(256):
        for code in range(16):
            packed = torch.full((1, 16), code | (code << 4), dtype=torch.uint8)
            scales = torch.full((1, 1), scale, dtype=torch.uint8)
            value = torch.tensor(E2M1_VALUES[code & 7] * 2.0 ** (scale - 127), dtype=torch.float64)
            finite = scale != 255 and bool(torch.isfinite(value.to(dtype)))
            try:
                check_mxfp4_values(packed, scales, dtype)
                refused = False
            except QuantFormatError:
                refused = True
            assert refused != finite, (scale, code, dtype)


def test_dequantising_a_scale_of_254_is_refused_not_infinite():
    packed = torch.full((1, 16), 0x77, dtype=torch.uint8)  # code 7 = 6.0 everywhere
    with pytest.raises(QuantFormatError, match=r"weight_scale\[0, 0\] = 254 .* beyond float32"):
        dequantize_mxfp4(packed, torch.tensor([[254]], dtype=torch.uint8), torch.float32)
    assert torch.equal(dequantize_mxfp4(packed, torch.tensor([[252]], dtype=torch.uint8), torch.float32),
                       torch.full((1, 32), 6.0 * 2.0**125))


def _bad_scale(path: Path, value: int):
    """Expert 2's w1 scale [0, 0] set to ``value``, its group's codes to 6.0 (so 254 overflows in every dtype)."""
    _edit_tensor(path, SCALE, lambda t: t.__setitem__(SCALE, _set(t[SCALE], value)))
    _edit_tensor(path, PACKED, lambda t: t.__setitem__(PACKED, _set_row(t[PACKED])))


def _set(scale, value):
    scale = scale.clone()
    scale[0, 0] = value
    return scale


def _set_row(packed):
    packed = packed.clone()
    packed[0, :16] = 0x77
    return packed


@pytest.mark.parametrize("value", [254, 255])
def test_bad_e8m0_scale_is_refused_by_every_reader(mxfp4_source, tmp_path, value):
    """254 makes the group's weights infinite (NaN logits before), 255 is E8M0's NaN: from_pretrained, the converter
    (dequantising or keeping the experts quantized: the copy used to pass and fail later at load) all name the tensor."""
    path = _copy(mxfp4_source, tmp_path)
    _bad_scale(path, value)
    fragment = "weight_scale[0, 0] = 254" if value == 254 else "255"
    message = assert_converter_refuses(path, fragment, "E8M0" if value == 255 else "beyond float32", script_too=False)
    assert "experts.2.w1" in message
    with pytest.raises(CheckpointError) as error:
        convert_official_checkpoint(path, tmp_path / "kept", keep_quantized=True, progress=False)
    assert fragment in str(error.value) and PACKED.replace(".block_sparse_moe.", ".") in str(error.value).replace(
        ".block_sparse_moe.", ".")
    assert not (tmp_path / "kept").exists()
    message = _loaders_refuse(path, CheckpointError, fragment)
    assert "experts" in message and "expert 2 w1" in message


def test_exporter_refuses_a_bad_scale_in_a_kept_quantized_checkpoint(mxfp4_source, tmp_path):
    """A kept-quantized directory whose scale was changed afterwards: both export modes (copy and dequantise)."""
    kept = tmp_path / "kept"
    convert_official_checkpoint(mxfp4_source, kept, keep_quantized=True, progress=False)
    name = SCALE.replace(".block_sparse_moe.", ".mlp.")
    packed = name.replace("weight_scale", "weight_packed")
    _edit_tensor(kept, name, lambda t: t.__setitem__(name, _set(t[name], 254)))
    _edit_tensor(kept, packed, lambda t: t.__setitem__(packed, _set_row(t[packed])))
    for mxfp4 in (True, False):
        with pytest.raises(CheckpointError, match=r"weight_scale\[0, 0\] = 254") as error:
            export_to_official(kept, tmp_path / "out", mxfp4=mxfp4, progress=False)
        assert "experts.2.w1" in str(error.value)
        assert not (tmp_path / "out").exists()
    _loaders_refuse(kept, CheckpointError, "weight_scale[0, 0] = 254")


def test_float16_load_refuses_scales_that_overflow_float16(mxfp4_source, tmp_path):
    """2^16 is finite in bf16 and fp32 but infinite in fp16: the load checks in the dtype the model is built in."""
    path = _copy(mxfp4_source, tmp_path)
    _bad_scale(path, 127 + 16)
    _loaders_refuse(path, CheckpointError, "beyond float16", dtype=torch.float16)
    from transformers_k3 import KimiK3Mxfp4Config

    model = KimiK3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                              quantization_config=KimiK3Mxfp4Config(dequantize=True))
    weight = model.get_parameter("model.layers.3.mlp.experts.gate_up_proj")[2, 0, :32]
    assert torch.equal(weight, torch.full((32,), 6.0 * 2.0**16, dtype=torch.bfloat16))


# --------------------------------------------------------------------------------------------------
# Factors that vanish in the model's dtype
@pytest.mark.parametrize("field, value", [("logit_scale", 1e-46), ("activation_situ_beta", 1e-320),
                                          ("activation_situ_linear_beta", 1e-40), ("routed_scaling_factor", 1e-39),
                                          ("router_aux_loss_coef", 1e-320), ("logit_scale", 1e39)])
def test_factors_that_vanish_in_float32_are_refused(field, value):
    assert float(torch.tensor(value, dtype=torch.float32)) == 0 or abs(float(torch.tensor(value))) < 2.0**-126 or \
        not torch.isfinite(torch.tensor(value, dtype=torch.float32))
    with pytest.raises(KimiK3ConfigError, match=f"`{field}`"):
        KimiK3TextConfig.tiny(**{field: value})


def test_gate_lower_bound_that_vanishes_is_refused():
    with pytest.raises(KimiK3ConfigError, match="`linear_attn_config.gate_lower_bound`"):
        KimiK3TextConfig.tiny(linear_attn_config={"gate_lower_bound": -1e-320})


def test_logit_scale_that_vanishes_in_float16_is_refused_when_building_in_float16(tmp_path):
    """1e-6 is a normal fp32 number but subnormal in fp16, where the logits are scaled: refused for fp16 builds and
    loads, accepted (and applied) in fp32."""
    config = KimiK3TextConfig.tiny(logit_scale=1e-6)
    assert 0 < abs(float(torch.tensor(1e-6, dtype=torch.float16))) < torch.finfo(torch.float16).tiny
    ids = torch.tensor([[3, 4, 5]])
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(config).eval()
    reference = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits * 1e-6, rtol=1e-5, atol=0)
    with pytest.raises(KimiK3ConfigError, match="`logit_scale`.*float16"):
        KimiK3ForCausalLM._from_config(config, dtype=torch.float16)
    model.save_pretrained(tmp_path / "saved")
    for loader in (KimiK3ForCausalLM, AutoModelForCausalLM):
        with pytest.raises(KimiK3ConfigError, match="`logit_scale`"):
            loader.from_pretrained(tmp_path / "saved", dtype=torch.float16)
    KimiK3ForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16)


def test_config_json_with_a_vanishing_factor_is_refused_at_load(bf16_source, tmp_path):
    path = _copy(bf16_source, tmp_path)
    _edit_config(path, lambda c: c.__setitem__("logit_scale", 1e-46))
    with pytest.raises(KimiK3ConfigError, match="`logit_scale`"):
        KimiK3ForCausalLM.from_pretrained(path)
    assert_converter_refuses(path, "`logit_scale`", script_too=False)


# --------------------------------------------------------------------------------------------------
# Absurd sizes: refused before memory is taken
def test_parameter_count_from_the_fields_matches_the_built_model():
    """Computed arithmetically (matrices only): within a few percent of the model built on the meta device, never
    above it."""
    configs = [KimiK3TextConfig.tiny(), KimiK3TextConfig.tiny(num_experts=None),
               KimiK3TextConfig.tiny(q_lora_rank=None, mla_use_output_gate=False, routed_expert_hidden_size=None,
                                     linear_attn_config={"use_full_rank_gate": False}),
               KimiK3TextConfig.tiny(hidden_size=256, vocab_size=4096, num_experts=16)]
    for config in configs:
        with torch.device("meta"):
            model = KimiK3ForCausalLM(config)
        built = sum(p.numel() for p in model.parameters())
        assert 0.9 * built <= config.parameter_count() <= built, (config.parameter_count(), built)
    assert 2.7e12 < KimiK3TextConfig().parameter_count() < 2.9e12  # the release: about 2.8e12


_PEAK_RSS = textwrap.dedent("""
    import json, resource, sys
    vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
    import torch, transformers_k3
    from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig
    from transformers_k3.convert import convert_official_checkpoint
    vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + 2 * 2**30, resource.RLIM_INFINITY))  # a failure is MemoryError
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = []
    for what in sys.argv[2:]:
        try:
            if what == "from_pretrained":
                KimiK3ForCausalLM.from_pretrained(sys.argv[1])
            elif what == "convert":
                convert_official_checkpoint(sys.argv[1], sys.argv[1] + "-out", progress=False)
            else:
                KimiK3ForCausalLM(KimiK3TextConfig.tiny(**json.loads(what)))
            results.append(["loaded", ""])
        except BaseException as error:
            results.append([type(error).__name__, str(error)[:2000]])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"results": results, "grown_kb": grown}))
""")


def _run_bounded(path, *what) -> tuple[list, int]:
    result = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(path), *what], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return data["results"], data["grown_kb"]


def test_absurd_layer_count_in_config_json_is_refused_before_allocating(bf16_source, tmp_path):
    """The issue's case: num_hidden_layers 10**12 grew the converter and from_pretrained to 24 GB. Now a named error,
    with the peak RSS of the process grown by less than 64 MB (and a 2 GB address-space limit to keep a failure
    small)."""
    path = _copy(bf16_source, tmp_path)
    _edit_config(path, lambda c: c.__setitem__("num_hidden_layers", 10**12))
    results, grown = _run_bounded(path, "from_pretrained", "convert", json.dumps({"num_hidden_layers": 10**12}))
    assert results[0][0] == "KimiK3ConfigError" and "`num_hidden_layers`" in results[0][1], results
    assert results[1][0] == "CheckpointError" and "`num_hidden_layers`" in results[1][1], results
    assert results[2][0] == "KimiK3ConfigError" and "<= 4096" in results[2][1], results
    assert grown < 64 * 1024, grown


def test_config_too_large_for_the_files_on_disk_is_refused_before_allocating(bf16_source, tmp_path):
    """hidden_size 2**20 passes every field check but makes about 4e9 parameters; the checkpoint holds under a MB.
    Refused by comparing the arithmetic parameter count with the bytes on disk; from_config of a config past
    1e14 parameters is refused with the limit."""
    path = _copy(bf16_source, tmp_path)
    _edit_config(path, lambda c: c.__setitem__("hidden_size", 2**20))
    huge = json.dumps({"num_experts": 2**31 - 1, "moe_intermediate_size": 2**31 - 1})
    results, grown = _run_bounded(path, "from_pretrained", "convert", huge)
    for kind, message in results[:2]:
        assert kind == "CheckpointError" and "does not belong to these files" in message, results
    assert results[2][0] == "KimiK3ConfigError" and "more than the limit of 1e+14" in results[2][1], results
    assert grown < 64 * 1024, grown


# --------------------------------------------------------------------------------------------------
# Integer tensors a quantizer never stores; a text_config that is not one
def test_int32_weight_behind_a_bitsandbytes_config_is_refused(tmp_path):
    """bitsandbytes stores uint8 (4-bit) or int8 (8-bit); an int32 weight under its config loaded, then failed with a
    bare AssertionError at the first forward."""
    torch.manual_seed(0)
    KimiK3ForCausalLM(KimiK3TextConfig.tiny()).save_pretrained(tmp_path / "m", save_original_format=False)
    path = tmp_path / "m"
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = torch.ones(64, 64, dtype=torch.int32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(path, lambda c: c.__setitem__("quantization_config",
                                               {"quant_method": "bitsandbytes", "load_in_4bit": True}))
    _loaders_refuse(path, CheckpointError, name, "stored as int32", "bitsandbytes", "uint8")


@pytest.mark.parametrize("value", ["x", 3, ["a"]])
def test_text_config_that_is_not_a_dict_is_named(bf16_source, tmp_path, value):
    path = _copy(bf16_source, tmp_path)
    (path / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": value}))
    for loader in (KimiK3ForCausalLM, AutoModelForCausalLM):
        with pytest.raises(KimiK3ConfigError, match="`text_config`"):
            loader.from_pretrained(path)
    from transformers_k3 import KimiK3Config

    with pytest.raises(KimiK3ConfigError, match="`text_config`"):
        KimiK3TextConfig.from_pretrained(path)
    with pytest.raises(KimiK3ConfigError, match="`text_config`"):
        KimiK3Config.from_pretrained(path)
