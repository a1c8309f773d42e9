"""What several test files share: builders of tiny models and checkpoints, and independent references (float64
formulas, fla's naive code, in-tree Kimi Linear, the release's inventory rules). Test files import from here, never
from each other; pytest fixtures stay in conftest.py."""

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig
from transformers_k3.conversion import CheckpointError
from transformers_k3.convert import convert_official_checkpoint
from transformers_k3.conversion import kimi_linear_to_k3_state_dict  # the in-tree -> K3 key map
from transformers_k3.convert.export import official_config_dict
from transformers_k3.conversion.keymap import FP32_TENSOR_RE, k3_to_official_state_dict, release_quantization_config
from transformers_k3.conversion.streaming import write_state_dict
from transformers_k3.modeling_kimi_k3 import KimiK3SparseMoE


# --------------------------------------------------------------------------------------------------
# Models with random weights
def randomize_(model: torch.nn.Module, std: float = 0.08, seed: int = 0) -> torch.nn.Module:
    """Give every weight a random value (the paper's init zeroes the AttnRes pseudo-queries and the router
    bias, which would hide bugs in the score path)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if "norm" in name and param.dim() == 1:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(std * torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
    return model


def load(cls, path, **kwargs):
    """``cls.from_pretrained(path)`` in eval mode, asserting that nothing was missing, unexpected or mismatched."""
    model, info = cls.from_pretrained(path, output_loading_info=True, **kwargs)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, problems
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# The distributed tests' lr: at 1e-2 AdamW's first step turns fp32 rounding of near-zero gradient entries into
# loss differences above 1e-5 between summation orders (docs/correctness.md, "Training trajectories").
ADAMW_LR = 1e-3


def global_batch() -> torch.Tensor:
    return torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(0))


def adamw_losses(model: torch.nn.Module, steps: int = 3, parts: int = 1) -> list[float]:
    """The losses of ``steps`` AdamW steps (lr ``ADAMW_LR``) on the whole global batch: the single-process reference
    of the distributed workers' global-batch losses. ``parts > 1``: each step backpropagates the batch's equal parts
    one after the other, each loss scaled by ``1 / parts`` (the same gradient, summed in another order)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    losses = []
    for _ in range(steps):
        total = 0.0
        for ids in global_batch().chunk(parts):
            loss = model(input_ids=ids, labels=ids).loss / parts
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def train_losses(model: torch.nn.Module, ids: torch.Tensor, optimizer, steps: int, after_step=None) -> list[float]:
    """The loss before each of ``steps`` optimizer steps on next-token prediction of ``ids``; ``after_step`` (if
    given) is called after each step (e.g. Quantile Balancing's `RouterBalancer.step`)."""
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step()
        losses.append(loss.item())
    return losses


def global_batch_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the mean loss over the global batch (left cleared on the model)."""
    model(input_ids=global_batch(), labels=global_batch()).loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def gradients_rel_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest ``max |got - want| / max |want|`` over the parameters, and its parameter (fp32 rounding ~1e-7;
    the same parameters must have gradients)."""
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    return max(((got[n].float() - want[n]).abs().max().item() / want[n].abs().max().clamp_min(1e-30).item(), n)
               for n in want)


def run_torchrun(worker: str, *args: str, processes: int = 2, timeout: int = 600, env: dict | None = None) -> dict:
    """``modeling_tests/<worker>`` under torchrun on ``processes`` CPU processes (one thread each, this directory on
    the path): the ``RESULT {json}`` its rank 0 prints."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
           **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                           "--standalone", os.path.join(here, worker), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


# --------------------------------------------------------------------------------------------------
# fla's reference code, loaded by file path (fla's package __init__ imports Triton)
def load_fla_reference(relative_path: str):
    """Import `fla/<relative_path>` as a standalone module; skip the test if fla is not installed."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-linear-attention is not installed (pip install -e '.[dev]')")
    path = os.path.join(list(spec.submodule_search_locations)[0], relative_path)
    module_spec = importlib.util.spec_from_file_location("fla_ref_" + relative_path.replace("/", "_")[:-3], path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _load_fla_naive():
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None, "flash-linear-attention (fla) is not installed"
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    if not path.is_file():
        return None, f"fla has no {path}"
    module_spec = importlib.util.spec_from_file_location("_fla_kda_naive_by_path", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except ImportError as error:  # naive.py needs einops
        return None, f"cannot load fla's naive KDA: {error}"
    return module, None


# --------------------------------------------------------------------------------------------------
# KDA inputs
ATOL = 1e-5


def make_inputs(batch, length, heads, key_dim, value_dim, decay="k3", seed=0, v_heads=None, normalise=True):
    """Random KDA inputs. ``decay="k3"``: g = -5 sigmoid(.) as K3's gate produces (strongly negative
    cumulative decays); ``"weak"``: near-zero decays (long memory); ``"extreme"``: beyond the gate bound."""
    gen = torch.Generator().manual_seed(seed)
    v_heads = v_heads or heads
    q = torch.randn(batch, length, heads, key_dim, generator=gen)
    k = torch.randn(batch, length, heads, key_dim, generator=gen)
    if normalise:  # the delta rule is only stable for |k| ~ 1; without in-kernel l2norm, pass unit keys
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(batch, length, v_heads, value_dim, generator=gen)
    raw = torch.randn(batch, length, v_heads, key_dim, generator=gen)
    if decay == "k3":
        g = -5.0 * torch.sigmoid(raw + 1.0)
    elif decay == "weak":
        g = -1e-3 * torch.sigmoid(raw)
    else:
        g = -40.0 - 80.0 * torch.rand(raw.shape, generator=gen)
    beta = torch.rand(batch, length, v_heads, generator=gen)
    h0 = torch.randn(batch, v_heads, key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, h0


def assert_close(actual, expected, atol=ATOL):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert diff <= atol, f"max abs diff {diff:.3e} > {atol:.0e}"


# --------------------------------------------------------------------------------------------------
# MoE: the tiny MoE config and a float64 reference written from the spec formulas, one token at a time
def make_config(**overrides):
    """The MoE fields of the tiny test config of spec section 11."""
    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=1,
        routed_expert_hidden_size=32,
        latent_moe_use_norm=True,
        moe_router_activation_func="sigmoid",
        moe_renormalize=True,
        routed_scaling_factor=2.5,
        num_expert_group=1,
        topk_group=1,
        hidden_act="situ",
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        rms_norm_eps=1e-5,
        router_fp32=False,
        _experts_implementation="eager",
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


@torch.no_grad()
def randomize(module, seed=0):
    """Fill every parameter and floating buffer with fan-in scaled noise (so that activations are O(1) and
    the soft caps are exercised), the correction bias with small noise and norm weights around 1."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)
        elif "norm" in name:
            tensor.copy_(1 + torch.randn(tensor.shape, generator=gen) * 0.2)
        else:
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 1.0 / math.sqrt(tensor.shape[-1]))
    return module


def make_moe(seed=0, **overrides):
    cfg = make_config(**overrides)
    return cfg, randomize(KimiK3SparseMoE(cfg), seed)


def ref_glu(a, u, cfg):
    if cfg.hidden_act == "silu":
        return a * torch.sigmoid(a) * u
    beta, lin = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    return beta * torch.tanh(a / beta) * torch.sigmoid(a) * (u if lin is None else lin * torch.tanh(u / lin))


def ref_route(y, w_router, bias, cfg):
    """Returns (selected expert ids as a list, their weights as a list) for one token ``y [H]``."""
    logits = w_router @ y
    s = torch.softmax(logits, -1) if cfg.moe_router_activation_func == "softmax" else torch.sigmoid(logits)
    s_biased = (s + bias).tolist()
    candidates = list(range(cfg.num_experts))
    if cfg.num_expert_group > 1:
        per_group = cfg.num_experts // cfg.num_expert_group
        group_score = [
            sum(sorted(s_biased[g * per_group : (g + 1) * per_group], reverse=True)[:2])
            for g in range(cfg.num_expert_group)
        ]
        kept = sorted(range(cfg.num_expert_group), key=lambda g: -group_score[g])[: cfg.topk_group]
        candidates = [e for e in candidates if e // per_group in kept]
    chosen = sorted(candidates, key=lambda e: -s_biased[e])[: cfg.num_experts_per_tok]
    weights = [s[e].item() for e in chosen]
    if cfg.moe_renormalize:
        total = sum(weights)
        weights = [w / (total + 1e-20) for w in weights]
    return chosen, [w * cfg.routed_scaling_factor for w in weights]


def ref_moe(moe, x, cfg, stacks=None):
    """The MoE layer (spec 6.2, 6.3) in float64 from the spec's formulas, one token at a time: router, routed
    experts' GLU, latent norm, up projection and shared expert. ``stacks``: the experts' weights in float64,
    ``(gate_up [E, 2I, H'], down [E, H', I])`` (packed experts dequantized); None: the module's own
    ``gate_up_proj`` / ``down_proj``."""
    p = {k: v.detach().double() for k, v in moe.state_dict().items()}
    gate_up, down = stacks if stacks is not None else (p["experts.gate_up_proj"], p["experts.down_proj"])
    out = []
    for y in x.double().reshape(-1, cfg.hidden_size):
        chosen, weights = ref_route(y, p["gate.weight"], p["gate.e_score_correction_bias"], cfg)
        latent = cfg.routed_expert_hidden_size is not None
        z = p["routed_expert_down_proj.weight"] @ y if latent else y
        i = cfg.moe_intermediate_size
        r = torch.zeros_like(z)
        for e, w in zip(chosen, weights):
            r = r + w * (down[e] @ ref_glu(gate_up[e, :i] @ z, gate_up[e, i:] @ z, cfg))
        if latent and cfg.latent_moe_use_norm:
            r = r / torch.sqrt((r * r).mean() + cfg.rms_norm_eps) * p["routed_expert_norm.weight"]
        routed = p["routed_expert_up_proj.weight"] @ r if latent else r
        if cfg.num_shared_experts > 0:
            a, u = p["shared_experts.gate_proj.weight"] @ y, p["shared_experts.up_proj.weight"] @ y
            routed = routed + p["shared_experts.down_proj.weight"] @ ref_glu(a, u, cfg)
        out.append(routed)
    return torch.stack(out).reshape(x.shape)


def ref_experts(experts, x, idx, w, probe):
    """Float64 per-token, per-slot loop: the output and the gradients of ``(output * probe).sum()`` with respect
    to ``x``, ``w``, ``gate_up_proj`` and ``down_proj``."""
    cfg, i = experts.config, experts.intermediate_dim
    x, w = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    gate_up = experts.gate_up_proj.detach().double().requires_grad_()
    down = experts.down_proj.detach().double().requires_grad_()
    rows = [
        sum(
            w[t, j] * (down[e] @ ref_glu(gate_up[e, :i] @ x[t], gate_up[e, i:] @ x[t], cfg))
            for j, e in enumerate(idx[t].tolist())
        )
        for t in range(x.shape[0])
    ]
    out = torch.stack(rows)
    (out * probe.double()).sum().backward()
    return out, (x.grad, w.grad, gate_up.grad, down.grad)


def modules_path(moe, x):
    """The layer through its modules (no whole-layer decode kernel)."""
    with torch.no_grad():
        return moe._modules_forward(x.reshape(-1, x.shape[-1])).view(x.shape)


# --------------------------------------------------------------------------------------------------
# A K3 model that is Kimi Linear (K3's features off) next to transformers' in-tree Kimi Linear, same weights
HIDDEN, LAYERS, HEADS, VOCAB = 64, 6, 4, 512
KDA_HEADS, KDA_DIM = 4, 16


def kimi_linear_config(**overrides) -> KimiLinearConfig:
    values = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True,
        hidden_act="silu", rms_norm_eps=1e-5, num_local_experts=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False,
        linear_attn_config={"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6], "num_heads": KDA_HEADS,
                            "head_dim": KDA_DIM, "short_conv_kernel_size": 4},
        first_k_dense_replace=1,
    )
    values.update(overrides)
    return KimiLinearConfig(**values)


def k3_config_matching(kl: KimiLinearConfig) -> KimiK3TextConfig:
    return KimiK3TextConfig(
        vocab_size=kl.vocab_size, hidden_size=kl.hidden_size, intermediate_size=kl.intermediate_size,
        num_hidden_layers=kl.num_hidden_layers, num_attention_heads=kl.num_attention_heads,
        q_lora_rank=kl.q_lora_rank, kv_lora_rank=kl.kv_lora_rank, qk_nope_head_dim=kl.qk_nope_head_dim,
        qk_rope_head_dim=kl.qk_rope_head_dim, v_head_dim=kl.v_head_dim, mla_use_output_gate=False,
        hidden_act="silu", rms_norm_eps=kl.rms_norm_eps, num_experts=kl.num_local_experts,
        num_experts_per_token=kl.num_experts_per_tok, num_shared_experts=kl.n_shared_experts,
        moe_intermediate_size=kl.moe_intermediate_size, routed_expert_hidden_size=None,
        latent_moe_use_norm=False, first_k_dense_replace=1, routed_scaling_factor=kl.routed_scaling_factor,
        num_expert_group=kl.n_group, topk_group=kl.topk_group, attn_res_block_size=None,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        # Kimi Linear's norm eps choices (K3_SPEC.md section 12): q_a/kv_a norms 1e-6, KDA o_norm rms_norm_eps
        mla_latent_norm_eps=1e-6, kda_o_norm_eps=kl.rms_norm_eps,
        linear_attn_config={"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6], "num_heads": KDA_HEADS,
                            "head_dim": KDA_DIM, "short_conv_kernel_size": 4, "use_full_rank_gate": False,
                            "gate_lower_bound": None},
    )


def build_pair(seed: int = 0, attn_implementation: str = "eager"):
    torch.manual_seed(seed)
    kl_config = kimi_linear_config()
    kl_config._attn_implementation = attn_implementation
    reference = KimiLinearForCausalLM(kl_config).eval()
    with torch.no_grad():  # the in-tree init leaves some weights at exactly 0/1; randomise everything
        for name, param in reference.named_parameters():
            if "A_log" in name or "dt_bias" in name:
                continue
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif param.dim() > 1:
                param.normal_(0, 0.08)
        for layer in reference.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    k3_config = k3_config_matching(kl_config)
    k3_config._attn_implementation = attn_implementation
    model = KimiK3ForCausalLM(k3_config).eval()
    state = kimi_linear_to_k3_state_dict(reference.state_dict(), KDA_HEADS)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return reference, model


# --------------------------------------------------------------------------------------------------
# Official-format checkpoints (bf16 or MXFP4 experts, several shards with an index) and the converter's CLI
REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "conversion"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MXFP4_QC = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                    "dynamic": False},
        "input_activations": None, "targets": ["re:.*mlp.experts.*"], "format": "mxfp4-pack-quantized"}},
    "ignore": ["lm_head"],
}
OFFICIAL_SHARD = 40_000  # bytes: the tiny checkpoints split into ~10 shards, experts of one layer across several


def representable(shape, generator) -> torch.Tensor:
    """Values MXFP4 represents exactly: E2M1 codes times one power of two per 32 consecutive inputs."""
    codes = torch.randint(0, 16, shape, generator=generator)
    exponents = torch.randint(-9, -5, (*shape[:-1], shape[-1] // 32), generator=generator)
    return torch.ldexp(E2M1[codes], exponents.repeat_interleave(32, dim=-1).float())


def representable_tiny(cls=KimiK3ForCausalLM, config=None):
    """A tiny ``cls`` (default config ``KimiK3TextConfig.tiny()``) with random weights (seed 0) in eval mode and
    bf16, its routed experts' weights values MXFP4 represents exactly (an MXFP4 checkpoint of it holds them all)."""
    torch.manual_seed(0)
    model = randomize_(cls(config if config is not None else KimiK3TextConfig.tiny()).eval())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(representable(param.shape, gen))
    return model.to(torch.bfloat16)


def official_state(model, quantize: bool) -> dict:
    """The model's weights under official names: per-expert experts, fp32 where the release keeps fp32."""
    state = {k: (v.float() if FP32_TENSOR_RE.search(k) else v.to(torch.bfloat16)) for k, v in model.state_dict().items()}
    return k3_to_official_state_dict(state, quantize_experts=quantize)


def write_official(directory: Path, state: dict, config, composite: bool, quantized: bool, shard=OFFICIAL_SHARD) -> Path:
    shutil.rmtree(directory, ignore_errors=True)
    write_state_dict(state, directory, max_shard_size=shard)
    config_dict = official_config_dict(config, composite)
    if quantized:
        (config_dict["text_config"] if composite else config_dict)["quantization_config"] = MXFP4_QC
    (directory / "config.json").write_text(json.dumps(config_dict, indent=1))
    return directory


def write_official_text(directory: Path, model, quantized: bool) -> Path:
    """``model`` written at ``directory`` as an official text checkpoint, its experts MXFP4 (``quantized``) or bf16."""
    return write_official(directory, official_state(model, quantize=quantized), model.config, False, quantized)


def write_tiny_official(path: Path) -> Path:
    """The tiny random K3 (bf16) written at ``path`` in the release's bf16 layout."""
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()).to(torch.bfloat16)
    return write_official_text(path, model, quantized=False)

def shard_tensors(directory: Path) -> dict:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def shard_tensors_file(shard: Path) -> dict:
    with safe_open(str(shard), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def listing(directory: Path) -> dict:
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in sorted(directory.rglob("*"))}


def assert_converter_refuses(path: Path, *fragments, script_too=True):
    """The converter raises `CheckpointError` with every fragment, the CLI exits 2 with one `error:` line and
    no traceback, and nothing is written next to the output nor changed in the input."""
    before = listing(path)
    out = path.parent / "out"
    with pytest.raises(CheckpointError) as error:
        convert_official_checkpoint(path, out, progress=False)
    message = str(error.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert not out.exists() and not list(path.parent.glob(".out*"))
    if script_too:
        argv = ["--input", str(path), "--output", str(out), "--quiet"]
        if script_too == "subprocess":  # the real exit status of the command line
            result = subprocess.run([sys.executable, str(SCRIPTS / "convert_k3_official_to_hf.py"), *argv],
                                    capture_output=True, text=True)
            status, stderr = result.returncode, result.stderr
        else:
            stream = io.StringIO()
            with contextlib.redirect_stderr(stream):
                status = _script("convert_k3_official_to_hf").main(argv)
            stderr = stream.getvalue()
        assert status == 2, stderr
        assert stderr.startswith("error: ") and "Traceback" not in stderr, stderr
        assert not out.exists() and not list(path.parent.glob(".out*"))
    assert listing(path) == before
    return message


def _start_conversion(ckpt: Path, out: Path, sleep: float) -> subprocess.Popen:
    env = dict(os.environ, TRANSFORMERS_K3_TEST_SLEEP_AFTER_SHARD=str(sleep))
    return subprocess.Popen([sys.executable, str(SCRIPTS / "convert_k3_official_to_hf.py"), "--input", str(ckpt),
                             "--output", str(out), "--quiet", "--max-shard-size", "40KB"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_default_sighup)


def _default_sighup():
    """The converter as a terminal starts it: a suite run under ``nohup`` passes SIGHUP on ignored, which the
    converter rightly keeps ignoring."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _wait_for_shards(out: Path, process: subprocess.Popen, timeout=60.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(out.parent.glob(f".{out.name}.tmp-k3-{process.pid}"))
        if found and list(found[0].glob("*.safetensors")):
            time.sleep(0.3)  # the first input shard is written, the converter sleeps
            return found[0]
        assert process.poll() is None, process.stderr.read().decode()
        time.sleep(0.05)
    raise AssertionError("the conversion never started writing")


# --------------------------------------------------------------------------------------------------
# The release's layout, written from its published inventory rules independently of the package's key maps
RELEASE_SHARD = 60_000
BF16, FP32, U8 = torch.bfloat16, torch.float32, torch.uint8


# The release's inventory rules (spec 2.2 + 13), independent of the package's key maps
def release_inventory(c, composite: bool, mxfp4: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of a release checkpoint for the text config ``c``."""
    H, V, L = c.hidden_size, c.vocab_size, c.num_hidden_layers
    lin = c.linear_attn_config
    nh, dk, K = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    P = nh * dk
    n, dn, dr, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    E, I, Hl, sh = c.num_experts, c.moe_intermediate_size, c.routed_expert_hidden_size, c.num_shared_experts * c.moe_intermediate_size
    root = "language_model." if composite else ""
    inv = {}

    def put(name, shape, dtype=BF16):
        inv[root + name] = (tuple(shape), dtype)

    put("model.embed_tokens.weight", (V, H))
    put("model.norm.weight", (H,))
    put("model.output_attn_res_norm.weight", (H,))
    put("model.output_attn_res_proj.weight", (1, H))
    put("lm_head.weight", (V, H))
    for i in range(L):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            put(p + norm + ".weight", (H,))
        put(p + "self_attention_res_proj.weight", (1, H))
        put(p + "mlp_res_proj.weight", (1, H))
        a = p + "self_attn."
        if (i + 1) in lin["kda_layers"]:
            for proj in "qkvg":
                put(a + f"{proj}_proj.weight", (P, H))
            put(a + "b_proj.weight", (nh, H))
            put(a + "f_a_proj.weight", (dk, H))
            put(a + "f_b_proj.weight", (P, dk))
            for proj in "qkv":
                put(a + f"{proj}_conv1d.weight", (P, 1, K), FP32)
            put(a + "A_log", (max(nh, dk),), FP32)  # the release: [128] for 96 heads of 128 ([head_dim])
            put(a + "dt_bias", (P,), FP32)
            put(a + "o_norm.weight", (dk,), FP32)
            put(a + "o_proj.weight", (H, P))
        else:
            put(a + "q_a_proj.weight", (c.q_lora_rank, H))
            put(a + "q_a_layernorm.weight", (c.q_lora_rank,))
            put(a + "q_b_proj.weight", (n * (dn + dr), c.q_lora_rank))
            put(a + "kv_a_proj_with_mqa.weight", (c.kv_lora_rank + dr, H))
            put(a + "kv_a_layernorm.weight", (c.kv_lora_rank,))
            put(a + "kv_b_proj.weight", (n * (dn + dv), c.kv_lora_rank))
            put(a + "g_proj.weight", (n * dv, H))
            put(a + "o_proj.weight", (H, n * dv))
        if i < c.first_k_dense_replace:
            put(p + "mlp.gate_proj.weight", (c.intermediate_size, H))
            put(p + "mlp.up_proj.weight", (c.intermediate_size, H))
            put(p + "mlp.down_proj.weight", (H, c.intermediate_size))
            continue
        m = p + "block_sparse_moe."
        put(m + "gate.weight", (E, H))
        put(m + "gate.e_score_correction_bias", (E,), FP32)
        for e in range(E):
            for w, (rows, cols) in (("w1", (I, Hl)), ("w3", (I, Hl)), ("w2", (Hl, I))):
                if mxfp4:
                    put(m + f"experts.{e}.{w}.weight_packed", (rows, cols // 2), U8)
                    put(m + f"experts.{e}.{w}.weight_scale", (rows, cols // 32), U8)
                else:
                    put(m + f"experts.{e}.{w}.weight", (rows, cols))
        put(m + "shared_experts.gate_proj.weight", (sh, H))
        put(m + "shared_experts.up_proj.weight", (sh, H))
        put(m + "shared_experts.down_proj.weight", (H, sh))
        put(m + "routed_expert_down_proj.weight", (Hl, H))
        put(m + "routed_expert_norm.weight", (Hl,))
        put(m + "routed_expert_up_proj.weight", (H, Hl))
    return inv


# The release's name patterns (spec 13), one regex per kind of tensor, with the dtype each must have
_L = r"(?:language_model\.)?model\.layers\.\d+\."
RELEASE_RULES = [
    (rf"^{_L}self_attn\.(?:A_log|dt_bias|[qkv]_conv1d\.weight|o_norm\.weight)$", FP32),
    (rf"^{_L}block_sparse_moe\.gate\.e_score_correction_bias$", FP32),
    (rf"^{_L}block_sparse_moe\.experts\.\d+\.w[123]\.(?:weight_packed|weight_scale)$", U8),
    (rf"^{_L}block_sparse_moe\.experts\.\d+\.w[123]\.weight$", BF16),
    (rf"^{_L}block_sparse_moe\.(?:gate|shared_experts\.(?:gate|up|down)_proj|routed_expert_(?:down_proj|norm|up_proj))\.weight$", BF16),
    (rf"^{_L}mlp\.(?:gate|up|down)_proj\.weight$", BF16),
    (rf"^{_L}self_attn\.(?:[qkvgbo]_proj|f_[ab]_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|q_a_layernorm|kv_a_layernorm)\.weight$", BF16),
    (rf"^{_L}(?:input_layernorm|post_attention_layernorm|self_attention_res_norm|self_attention_res_proj|mlp_res_norm|mlp_res_proj)\.weight$", BF16),
    (r"^(?:language_model\.)?(?:model\.(?:embed_tokens|norm|output_attn_res_norm|output_attn_res_proj)|lm_head)\.weight$", BF16),
    (r"^(?:vision_tower|mm_projector)\.", BF16),
]


def check_against_rules(tensors: dict, config, composite: bool, mxfp4: bool, dense_dtype=BF16):
    """Every tensor matches one release rule and has its dtype; the names and shapes are the inventory's."""
    text = config.get_text_config()
    inventory = release_inventory(text, composite, mxfp4)
    for name, t in tensors.items():
        rules = [dtype for pattern, dtype in RELEASE_RULES if re.search(pattern, name)]
        assert len(rules) == 1, (name, rules)
        want = dense_dtype if rules[0] is BF16 else rules[0]
        assert t.dtype == want, (name, t.dtype, want)
        if not name.startswith(("vision_tower.", "mm_projector.")):
            assert name in inventory, name
            assert tuple(t.shape) == inventory[name][0], (name, list(t.shape), inventory[name][0])
        if name.endswith(".A_log"):
            nh = text.linear_attn_config["num_heads"]
            assert torch.count_nonzero(t[nh:]) == 0 and t.numel() > nh, name  # heads, then zeros
    missing = sorted(set(inventory) - set(tensors))
    assert not missing, missing[:5]
    assert not any(".mlp.experts" in n or "gate_up_proj" in n or "language_model.layers." in n for n in tensors)


def random_mxfp4(rows: int, cols: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and E8M0 scales as the release's quantiser leaves them: each 32-group's largest code is
    4 or 6 (a group maximum in [4, 8) times its scale rounds there)."""
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    top = torch.tensor([6, 7, 14, 15], dtype=torch.uint8)[torch.randint(0, 4, (rows, cols // 32), generator=gen)]
    codes[:, ::32] = top
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.randint(118, 124, (rows, cols // 32), generator=gen, dtype=torch.uint8)
    return packed.contiguous(), scale


def release_vision_state(config) -> dict:
    """Random bf16 vision tower and projector tensors for a composite release fixture, under the release's names."""
    from transformers_k3 import KimiK3ForConditionalGeneration

    with torch.device("meta"):
        meta = KimiK3ForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(3)
    vision = {name: (0.05 * torch.randn(tuple(t.shape), generator=gen)).to(BF16)
              for name, t in meta.state_dict().items() if name.startswith(("vision_tower.", "mm_projector."))}
    assert vision and all(re.search(RELEASE_RULES[-1][0], n) for n in vision)
    return vision


def release_state(config, composite: bool, mxfp4: bool, seed: int, vision_state=None) -> dict:
    gen = torch.Generator().manual_seed(seed)
    text = config.get_text_config()
    nh = text.linear_attn_config["num_heads"]
    state = {}
    for name, (shape, dtype) in release_inventory(text, composite, mxfp4).items():
        if dtype is U8:
            continue
        if name.endswith(".A_log"):
            t = torch.zeros(shape, dtype=FP32)
            t[:nh] = torch.log(torch.rand(nh, generator=gen) * 15 + 1)
        elif name.endswith(("norm.weight", "_layernorm.weight")):
            t = 1 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            t = 0.01 * torch.randn(shape, generator=gen)
        else:
            t = 0.08 * torch.randn(shape, generator=gen)
        state[name] = t.to(dtype)  # fp32 tensors keep full fp32 precision (o_norm included)
    if mxfp4:
        for name, (shape, dtype) in release_inventory(text, composite, mxfp4).items():
            if name.endswith("weight_packed"):
                rows, cols = shape[0], shape[1] * 2
                packed, scale = random_mxfp4(rows, cols, gen)
                state[name] = packed
                state[name[: -len("packed")] + "scale"] = scale
    if vision_state:
        state.update(vision_state)
    return state


def write_release(directory: Path, state: dict, config, composite: bool, mxfp4: bool) -> Path:
    write_state_dict(state, directory, max_shard_size=RELEASE_SHARD)
    data = official_config_dict(config, composite, "bf16", release_quantization_config() if mxfp4 else None)
    (directory / "config.json").write_text(json.dumps(data, indent=1))
    return directory
