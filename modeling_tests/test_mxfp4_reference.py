"""Our MXFP4 release format checked against compressed-tensors itself (the library that wrote the release: its
format name, ``mxfp4-pack-quantized``, is in the release's config). Every expected byte comes from
compressed-tensors' own path: ``compute_dynamic_scales_and_zp`` (per-32-group min/max -> ``calculate_qparams``,
which is what llm-compressor's observers call) for the scale, then the registered ``mxfp4-pack-quantized``
compressor's ``compress`` / ``decompress``, or the whole-model ``ModelCompressor`` flow.

What compressed-tensors 0.20.1 does (compressors/mxfp4, quantization/utils/mxfp_utils.py, nvfp4/helpers.py):
  * scale: the group's absmax rounded to a power of two on its bit pattern (up iff its mantissa is >= 1.75),
    E8M0 code ``127 + floor(log2(that)) - 2``, clamped to 0..255 (a subnormal absmax masks to 0 -> code 0);
  * values: ``x / 2^(code-127)`` clamped to +-6 and rounded to the nearest E2M1 value, ties to even;
  * packing: code = magnitude index | sign << 3, even column in the low nibble;
  * decompression: E2M1 value * ``2 ** (code - 127)`` in bf16.
Two deliberate differences are pinned below: an exact ``-0.0`` input (compressed-tensors writes +0, we keep the
sign so dequantised release weights give back their bytes) and an absmax >= 1.75 * 2^127 (no finite scale there:
compressed-tensors writes an invalid one, we refuse)."""

import json

import pytest
import torch
from torch import nn

ct = pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import BaseCompressor, ModelCompressor  # noqa: E402
from compressed_tensors.compressors.mx_utils import decompress_mx_scale  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize  # noqa: E402
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp  # noqa: E402

from transformers_k3.conversion.keymap import release_quantization_config  # noqa: E402
from transformers_k3.conversion.quant import (  # noqa: E402
    QuantFormatError,
    dequantize_mxfp4,
    mxfp4_release_scale,
    quantize_mxfp4,
    quantize_mxfp4_release,
)

BF16, FP32 = torch.bfloat16, torch.float32
FORMAT = "mxfp4-pack-quantized"
# compressed-tensors' preset for weight-only MXFP4 (E2M1, symmetric groups of 32, uint8 E8M0 scales)
SCHEME = preset_name_to_scheme("MXFP4A16", ["Linear"])
COMPRESSOR = BaseCompressor.get_value_from_registry(FORMAT)


def ct_compress(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed, weight_scale) as compressed-tensors writes them for ``weight``."""
    scale, zero_point = compute_dynamic_scales_and_zp(weight, SCHEME.weights, module=None)
    out = COMPRESSOR.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, SCHEME)
    assert set(out) == {"weight_packed", "weight_scale"}  # symmetric: the zero point is dropped
    return out["weight_packed"], out["weight_scale"]


def ct_decompress(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' dequantisation: the compressor's own (bf16), or its pieces with an fp32 unpack."""
    if dtype is BF16:
        return COMPRESSOR.decompress({"weight_packed": packed, "weight_scale": scale}, SCHEME)["weight"]
    unpacked = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=dtype)
    return dequantize(unpacked, decompress_mx_scale(scale).to(dtype), args=SCHEME.weights, dtype=dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern (so -0.0 != +0.0 and NaN == NaN compare as bits)."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_matches_ct(weight: torch.Tensor):
    assert not bool(((weight == 0) & torch.signbit(weight)).any())  # -0.0 inputs are the pinned difference
    packed, scale = ct_compress(weight)
    ours = quantize_mxfp4_release(weight)
    assert torch.equal(ours[1], scale), (ours[1][ours[1] != scale][:8], scale[ours[1] != scale][:8])
    assert torch.equal(ours[0], packed), (ours[0][ours[0] != packed][:8], packed[ours[0] != packed][:8])
    assert torch.equal(mxfp4_release_scale(weight), scale)
    for dtype in (BF16, FP32):
        assert torch.equal(bits(dequantize_mxfp4(packed, scale, dtype)), bits(ct_decompress(packed, scale, dtype)))


def test_reference_is_the_mxfp4_compressor():
    # the format name the release's config carries selects this compressor, and the preset is what we assume
    assert COMPRESSOR.__name__ == "MXFP4PackedCompressor"
    w = SCHEME.weights
    assert (w.num_bits, w.type, w.strategy, w.group_size, w.symmetric, w.scale_dtype) == (
        4, "float", "group", 32, True, torch.uint8)


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_weights_match_compressed_tensors(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    # rows spread over 2^-40..2^40 with heavy-tailed outliers, so many scales and saturating groups occur
    w = torch.randn(64, 256, generator=gen) * torch.exp2(torch.randint(-40, 41, (64, 1), generator=gen).float())
    w = w * torch.where(torch.rand(64, 256, generator=gen) < 0.02, 30.0, 1.0)
    assert_matches_ct(w.to(dtype))
    assert_matches_ct((torch.randn(32, 128, generator=gen) * 0.02).to(dtype))  # typical trained-weight scale


def edge_groups() -> torch.Tensor:
    """One 32-group per row, every value exactly representable in bf16 (the same matrix serves both dtypes)."""
    gen = torch.Generator().manual_seed(7)
    ints = torch.randint(1, 128, (32,), generator=gen).float() * torch.where(torch.arange(32) % 3 == 0, -1.0, 1.0)
    rows = [torch.zeros(32)]  # all-zero group: smallest scale
    for e in (-126, -125, -124, -120, -3, 0, 60, 100, 120, 126):
        rows.append(ints / 128 * 2.0 ** e)  # subnormal and tiny (scale clamped at code 0), ordinary, huge
    sub = torch.randint(1, 8, (32,), generator=gen).float() * torch.where(torch.arange(32) % 2 == 0, -1.0, 1.0)
    rows.append(sub * 2.0 ** -133)  # absmax a few bf16 subnormal steps
    rows.append(torch.tensor([16.0, 48.0, 80.0, 112.0] * 4 + [-16.0, -48.0, -80.0, -112.0] * 4) * 2.0 ** -133)  # ties
    for m in (1.0, 1.5, 1.7421875, 1.75, 1.7578125, 1.9921875):  # absmax mantissa around the 1.75 round-up
        for e in (-126, -3, 0, 126) + ((127,) if m < 1.75 else ()):
            row = ints / 128 * 2.0 ** e
            row[5] = -m * 2.0 ** e
            rows.append(row)
    # midpoints between E2M1 values (and the values) at the scale an absmax of 6 gives, at three scales
    mids = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.25, 2.5, 2.75, 3.5, 4.5, 5.0, 5.5, 0.5, 1.0, 1.5, 2.0])
    mids = torch.cat([mids, -mids.flip(0)])
    for e in (-100, 0, 100):
        rows.append(mids * 2.0 ** e)
    rows.append(torch.tensor([7.0, 6.5, 5.9, 0.2, 0.3, 0.7, 0.8] + [0.1] * 25))  # 7: scale up; 0.2 -> 0, 0.3 -> 0.5
    rows.append(torch.tensor([6.9, -6.9] + [5.0] * 30))  # mantissa 1.725: stays, 6.9 saturates to 6
    w = torch.stack(rows).to(BF16).float()  # values like 6.9 become bf16's; the designed ones are exact already
    assert torch.equal(w[-5:-2].abs().amax(dim=1), torch.tensor([2.0 ** -100, 1.0, 2.0 ** 100]) * 6)
    return w.repeat(1, 2)  # two groups per row: the second one checks the group indexing


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_edge_groups_match_compressed_tensors(dtype):
    assert_matches_ct(edge_groups().to(dtype))


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_mxfp4_values_give_compressed_tensors_bytes_with_both_quantisers(dtype):
    """Weights that MXFP4 holds exactly (dequantised codes, tiny and huge scales): the exact quantiser and the
    release one write what compressed-tensors writes for them."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (64, 256), generator=gen, dtype=torch.uint8)
    codes[codes == 8] = 0  # -0 codes decode to -0.0: the pinned difference below
    codes[:4, :32] = torch.randint(0, 4, (4, 32), generator=gen, dtype=torch.uint8)  # small group maxima
    scale = torch.randint(0, 252, (64, 8), generator=gen, dtype=torch.uint8)  # <= 251: 6 * 2^124 stays finite
    scale[:12] = torch.randint(0, 6, (12, 8), generator=gen, dtype=torch.uint8)  # subnormal results
    w = dequantize_mxfp4((codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(), scale, dtype)
    packed, ct_scale = ct_compress(w)
    for ours in (quantize_mxfp4(w), quantize_mxfp4_release(w)):
        assert torch.equal(ours[0], packed) and torch.equal(ours[1], ct_scale)


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_negative_zero_keeps_its_sign_where_compressed_tensors_drops_it(dtype):
    """compressed-tensors codes an exact -0.0 input as +0 (its cast multiplies by ``sign(-0.0) = 0``) but a
    negative value that rounds to zero as -0; we code both -0, so a release's -0 codes survive dequantise ->
    requantise. Everything else in these groups is byte for byte compressed-tensors'."""
    w = edge_groups()[:, :32].clone()
    neg_zero = torch.zeros_like(w, dtype=torch.bool)
    neg_zero[:, 1::5] = w[:, 1::5] != 0  # some -0.0s among real values, one whole group of -0.0
    neg_zero[0] = True
    w[neg_zero] = -0.0
    w = w.to(dtype)
    packed, scale = ct_compress(w)
    ours_packed, ours_scale = quantize_mxfp4_release(w)
    assert torch.equal(ours_scale, scale)

    def nibbles(p):
        return torch.stack((p & 15, p >> 4), dim=-1).reshape(w.shape)

    theirs, ours = nibbles(packed), nibbles(ours_packed)
    assert bool((theirs[neg_zero] == 0).all()) and bool((ours[neg_zero] == 8).all())
    assert torch.equal(theirs[~neg_zero], ours[~neg_zero])
    assert bool((ours[~neg_zero] == 8).any())  # small negatives: -0 in both
    assert torch.equal(dequantize_mxfp4(ours_packed, scale, dtype), ct_decompress(packed, scale, dtype).to(dtype))


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_no_finite_scale_is_refused(dtype):
    """An absmax >= 1.75 * 2^127 rounds up to 2^128: compressed-tensors' float scale is inf there (it then writes
    a meaningless E8M0 byte and zeros); we raise. Just below, both agree."""
    w = torch.full((2, 32), 0.5 * 2.0 ** 127)
    w[0, 3] = 1.75 * 2.0 ** 127
    w = w.to(dtype)
    scale, _ = compute_dynamic_scales_and_zp(w, SCHEME.weights, module=None)
    assert bool(torch.isinf(scale[0]).all()) and bool(torch.isfinite(scale[1]).all())
    with pytest.raises(QuantFormatError, match="1.75"):
        quantize_mxfp4_release(w)
    with pytest.raises(QuantFormatError, match="1.75"):
        mxfp4_release_scale(w)
    w[0, 3] = 1.7421875 * 2.0 ** 127  # the largest bf16 below 1.75 * 2^127
    assert_matches_ct(w)


class _Experts(nn.Module):
    def __init__(self, n: int, k: int):
        super().__init__()
        for name, shape in (("w1", (n, k)), ("w3", (n, k)), ("w2", (k, n))):
            self.add_module(name, nn.Linear(shape[1], shape[0], bias=False, dtype=BF16))


def _release_like_model() -> nn.Module:
    """Linear layers under the release's names: routed experts (quantised) and what the release keeps bf16."""
    def tree(**children):
        m = nn.Module()
        for name, child in children.items():
            m.add_module(name, child)
        return m

    def lin(k=64, n=64):
        return nn.Linear(k, n, bias=False, dtype=BF16)

    dense = tree(self_attn=tree(q_proj=lin(), o_proj=lin()), mlp=tree(gate_proj=lin(), up_proj=lin(), down_proj=lin()))
    moe = tree(self_attn=tree(q_proj=lin()),
               block_sparse_moe=tree(experts=tree(**{str(e): _Experts(64, 128) for e in range(2)}),
                                     shared_experts=tree(gate_proj=lin(), up_proj=lin(), down_proj=lin())))
    model = tree(language_model=tree(model=tree(layers=tree(**{"0": dense, "1": moe})), lm_head=lin()),
                 vision_tower=tree(proj=lin()), mm_projector=tree(linear_1=lin()))
    gen = torch.Generator().manual_seed(5)
    for p in model.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.02).to(BF16)
    return model


def test_release_config_is_what_compressed_tensors_writes(tmp_path):
    """Our ``release_quantization_config()`` parses with compressed-tensors, its ignore list leaves exactly the
    routed experts quantised, and compressing a release-like model with compressed-tensors (ModelCompressor,
    the save path llm-compressor uses) writes our scheme, our bytes, and a config equal to ours apart from its
    informational keys and its spelled-out ignore list."""
    ours = release_quantization_config()
    parsed = QuantizationConfig.model_validate(ours)
    assert parsed.format == FORMAT and parsed.quantization_status == "compressed"
    # the preset's weights, except zp_dtype: compressed-tensors does not serialise it, and parsing its own written
    # config gives the same default as parsing ours (unused: symmetric scales have no zero point)
    assert parsed.config_groups["group_0"].weights.model_dump(exclude={"zp_dtype"}) == SCHEME.weights.model_dump(
        exclude={"zp_dtype"})
    assert BaseCompressor.get_value_from_registry(parsed.config_groups["group_0"].format) is COMPRESSOR

    model = _release_like_model()
    dense = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("MXFP4A16", ["Linear"])}, ignore=ours["ignore"]))
    quantised = sorted(name for name, m in model.named_modules() if getattr(m, "quantization_scheme", None))
    assert quantised == sorted(f"language_model.model.layers.1.block_sparse_moe.experts.{e}.{w}"
                               for e in range(2) for w in ("w1", "w2", "w3"))
    for name in quantised:  # the observer's job in llm-compressor: the weight scale from the weight's groups
        module = model.get_submodule(name)
        scale, _ = compute_dynamic_scales_and_zp(module.weight.data, module.quantization_scheme.weights, module)
        module.weight_scale.data.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model, FORMAT)
    compressor.compress_model(model)
    state = model.state_dict()
    for name in quantised:
        packed, scale = quantize_mxfp4_release(dense[name])
        assert torch.equal(state[name + ".weight_packed"], packed) and torch.equal(state[name + ".weight_scale"], scale)
        assert name + ".weight" not in state
    compressor.update_config(str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]

    for key in ("quant_method", "format", "quantization_status", "config_groups"):
        assert written[key] == ours[key], key
    # what compressed-tensors adds: its version and informational keys that are all empty for this format
    extra = {k: written[k] for k in set(written) - set(ours)}
    assert extra.pop("version") == ct.__version__
    assert extra == {"global_compression_ratio": None, "kv_cache_scheme": None, "moe_sparsity_config": None,
                     "sparsity_config": {}, "transform_config": {}}
    assert set(ours) - set(written) == set()
    # its ignore list names the bf16 Linear modules; ours (the release's) says the same with patterns
    ct_ignore = set(written["ignore"])
    assert ct_ignore == {name for name in dense if name not in quantised}
    parsed_written = QuantizationConfig.model_validate({k: v for k, v in written.items() if k in ours})
    assert parsed_written.model_dump(exclude={"ignore"}) == parsed.model_dump(exclude={"ignore"})
