"""Block Attention Residuals vs the spec's formulas (K3_SPEC.md 3.2/3.3, 11.1) and fla's naive AttnRes."""

import math

import pytest
import torch
import torch.nn.functional as F

from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig
from transformers_k3.modeling_kimi_k3 import KimiK3BlockAttnRes

from references import load, load_fla_reference, randomize_


def spec_attn_res(candidates, w, n, eps):
    """K3_SPEC.md 3.2 written out literally: RMSNorm with weight n, dot with w, softmax, mix raw candidates."""
    scores = torch.stack([(F.rms_norm(r.double(), (r.shape[-1],), n.double(), eps) * w.double()).sum(-1)
                          for r in candidates])
    alpha = scores.softmax(0)
    return sum(a.unsqueeze(-1) * r.double() for a, r in zip(alpha, candidates)), alpha


def attn_res_read(w, n, eps):
    """A read point (a layer's FFN side) holding pseudo-query ``w`` and key norm ``n``."""
    read = KimiK3BlockAttnRes(KimiK3TextConfig.tiny(hidden_size=w.numel(), rms_norm_eps=eps), layer_idx=1, side="mlp")
    with torch.no_grad():
        read.pseudo_query.copy_(w.view(1, -1))
        read.key_norm.copy_(n)
    return read


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("seq", [1, 5])
def test_read_matches_spec_formula_and_fla_naive(stacked, seq):
    """Both ways a read is computed (the candidates stacked, as for a decode step's small reads, or one by one, as
    for a long prefill's), each called on the same inputs, and the read point, at a decode step's and a short
    prompt's length, against the spec's formula in float64 and fla's naive AttnRes."""
    from transformers_k3.modeling_kimi_k3 import attn_res_mix, attn_res_read_stacked, attn_res_scores

    fla = load_fla_reference("ops/attnres/naive.py")
    torch.manual_seed(0)
    H, eps = 64, 1e-5
    candidates = [torch.randn(2, seq, H) * s for s in (1.0, 3.0, 0.5, 2.0)]
    w, n = torch.randn(H), 1 + 0.1 * torch.randn(H)
    read = attn_res_read(w, n, eps)
    if stacked:
        mix, alpha = attn_res_read_stacked(candidates, read.pseudo_query, read.key_norm, eps)
    else:
        alpha = attn_res_scores(candidates, read.pseudo_query, read.key_norm, eps)
        mix = attn_res_mix(candidates, alpha)
    want_mix, want_alpha = spec_attn_res(candidates, w, n, eps)
    read_mix, read_alpha = read(*candidates)
    assert (read_mix.double() - want_mix).abs().max() <= 1e-5
    assert (read_alpha.double() - want_alpha).abs().max() <= 1e-6
    assert (mix.double() - want_mix).abs().max() <= 1e-5
    assert (alpha.double() - want_alpha).abs().max() <= 1e-6
    ref_mix, ref_alpha = fla.naive_attnres(w, candidates, n, rms_eps=eps, return_weights=True)
    assert (mix - ref_mix).abs().max() <= 1e-5
    assert (alpha - ref_alpha).abs().max() <= 1e-6


def test_score_depends_only_on_norm_times_proj():
    """Invariant 11.1.3: (n, w) -> (1, n*w) leaves the read unchanged (the GGUF export relies on it)."""
    torch.manual_seed(1)
    H = 32
    candidates = [torch.randn(3, H) for _ in range(3)]
    w, n = torch.randn(H), torch.rand(H) + 0.5
    a = attn_res_read(w, n, 1e-6)(*candidates)[0]
    b = attn_res_read(n * w, torch.ones(H), 1e-6)(*candidates)[0]
    assert (a - b).abs().max() <= 1e-6


def _layer0_input(model, ids):
    captured = {}

    def grab(module, args, kwargs):
        captured["x"] = args[0] if args else kwargs["hidden_states"]

    handle = model.model.layers[0].self_attn.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(ids)
    handle.remove()
    return captured["x"]


def test_first_layer_reads_the_embeddings(tiny_model):
    """Invariant 11.1.2: layer 0's attention input is input_layernorm(embeddings) whatever the weights."""
    ids = torch.randint(3, 512, (2, 7))
    x = _layer0_input(tiny_model, ids)
    with torch.no_grad():
        want = tiny_model.model.layers[0].input_layernorm(tiny_model.model.embed_tokens(ids))
    assert torch.equal(x, want)


def test_a_model_built_from_a_config_starts_at_the_papers_init():
    """K3_SPEC.md 3.2: zero pseudo-queries and unit key norms, so every read of a fresh model is its candidates' mean."""
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()
    reads = [m for m in model.modules() if isinstance(m, KimiK3BlockAttnRes) and m.pseudo_query is not None]
    assert reads and all(not m.pseudo_query.any() and bool((m.key_norm == 1).all()) for m in reads)
    with torch.no_grad():
        out = model(torch.randint(3, 512, (1, 6)), output_attn_res_weights=True)
    for weights in out.attn_res_weights:
        assert torch.equal(weights, torch.full_like(weights, 1.0 / weights.shape[0]))


def test_zero_pseudo_queries_give_the_mean_of_candidates(tiny_model):
    with torch.no_grad():
        for layer in tiny_model.model.layers:
            layer.self_attention_res.pseudo_query.zero_()
            layer.mlp_res.pseudo_query.zero_()
        tiny_model.model.output_attn_res.pseudo_query.zero_()
    ids = torch.randint(3, 512, (1, 6))
    out = tiny_model(ids, output_attn_res_weights=True)
    for weights in out.attn_res_weights:
        assert torch.allclose(weights, torch.full_like(weights, 1.0 / weights.shape[0]), atol=1e-7)


def test_candidate_counts_follow_the_spec():
    """Invariant 11.1.1 for S in {1, 2, 4, >= L}: attention side 1 then ceil(l/S)+1, FFN side floor(l/S)+2,
    final ceil(L/S)+1."""
    for S in (1, 2, 4, 6, 9):
        config = KimiK3TextConfig.tiny(attn_res_block_size=S)
        model = KimiK3ForCausalLM(config).eval()
        out = model(torch.randint(3, 512, (1, 4)), output_attn_res_weights=True)
        got = [w.shape[0] for w in out.attn_res_weights]
        L = config.num_hidden_layers
        want = []
        for l in range(L):
            want += [1 if l == 0 else math.ceil(l / S) + 1, l // S + 2]
        want.append(math.ceil(L / S) + 1)
        assert got == want, (S, got, want)


def test_stack_matches_a_literal_reimplementation_of_the_spec(tiny_model):
    """The whole decoder dataflow of K3_SPEC.md 3.3, re-run by hand from the model's own sublayers and reads: the
    residual bookkeeping (bank, partial sums, snapshot rule, final read) is independent here, and every read, on
    the candidates that bookkeeping assembled, equals the spec's formula in float64."""
    model = tiny_model.model
    config = model.config
    ids = torch.randint(3, 512, (2, 9))
    eps = config.rms_norm_eps
    # Each read checked where it happens, then the model's own read carried on: a float64 read carried on instead
    # differs by fp32 rounding, which this random network amplifies to the output by an amount the seed decides.
    reads = []

    def read(module, candidates):
        mix, _ = module(*candidates)
        want, _ = spec_attn_res(candidates, module.pseudo_query[0], module.key_norm, eps)
        reads.append(((mix.double() - want).abs().max() / want.abs().max()).item())
        return mix

    with torch.no_grad():
        bank, p = [], model.embed_tokens(ids)
        for l, layer in enumerate(model.layers):
            x = layer.input_layernorm(read(layer.self_attention_res, bank + [p]))
            if l % config.attn_res_block_size == 0:
                bank, p = bank + [p], None
            a = layer.self_attn(x)
            a = a[0] if isinstance(a, tuple) else a
            p = a if p is None else p + a
            p = p + layer.mlp(layer.post_attention_layernorm(read(layer.mlp_res, bank + [p])))
        want = model.norm(read(model.output_attn_res, bank + [p]))
        got = model(ids).last_hidden_state
    assert len(bank) == math.ceil(config.num_hidden_layers / config.attn_res_block_size)
    assert len(reads) == 2 * config.num_hidden_layers + 1 and max(reads) <= 1e-6, reads
    assert (got - want).abs().max() <= 1e-6


def test_hidden_states_are_the_pre_norm_reads(tiny_model):
    """K3_SPEC.md section 9: the hidden state after layer i is the pre-norm mixture layer i+1's attention read
    forms; hidden_states[0] is the embeddings, the last is the normed output (transformers' convention)."""
    ids = torch.randint(3, 512, (1, 5))
    with torch.no_grad():
        out = tiny_model.model(ids, output_hidden_states=True)
    L = tiny_model.config.num_hidden_layers
    assert len(out.hidden_states) == L + 1
    assert torch.equal(out.hidden_states[0], tiny_model.model.embed_tokens(ids))
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)


def test_checkpoints_keep_the_release_names_and_both_layouts_load(tmp_path):
    """Each read owns its weights (``{read}.pseudo_query`` / ``{read}.key_norm``); checkpoints keep the release's
    ``{read}_proj.weight`` / ``{read}_norm.weight``: save_pretrained writes those, ``save_original_format=False`` the
    module's names, and both load back identically, as does the layout save_original_format=False wrote before the
    reads owned their weights (fused experts, the release's AttnRes names)."""
    from safetensors.torch import load_file, save_file

    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval(), seed=5)
    ids = torch.randint(3, 512, (1, 6))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path / "release", save_original_format=True)
    model.save_pretrained(tmp_path / "ours", save_original_format=False)
    release = load_file(tmp_path / "release" / "model.safetensors")
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    reads = [f"model.layers.{i}.{side}" for i in range(6) for side in ("self_attention_res", "mlp_res")]
    reads.append("model.output_attn_res")
    for read in reads:
        assert f"{read}_proj.weight" in release and f"{read}_norm.weight" in release
        assert torch.equal(ours[f"{read}.pseudo_query"], release[f"{read}_proj.weight"])
        assert torch.equal(ours[f"{read}.key_norm"], release[f"{read}_norm.weight"])
    assert not any(name.endswith((".pseudo_query", ".key_norm")) for name in release)
    before = tmp_path / "before"
    before.mkdir()
    for f in (tmp_path / "ours").iterdir():
        if f.suffix != ".safetensors":
            (before / f.name).write_bytes(f.read_bytes())
    save_file({(k.replace(".pseudo_query", "_proj.weight").replace(".key_norm", "_norm.weight")): v
               for k, v in ours.items()}, str(before / "model.safetensors"), metadata={"format": "pt"})
    for directory in ("release", "ours", "before"):
        with torch.no_grad():
            assert torch.equal(load(KimiK3ForCausalLM, tmp_path / directory)(ids).logits, want), directory
