"""The fused CPU kernels (transformers_k3/ops/csrc): when each runs; the KDA kernel against fla's naive
reference on its own code paths (factored and exact pairwise decays, several threads, packed sequences);
the routed-experts kernel against a float64 per-token loop written from the spec (SiTU with and without
the up cap, SiLU, experts split over several tasks, transposed weights, sentinels, no tokens); and that
building them is cached, atomic and falls back cleanly. The numerics of every public KDA entry point are
also run with the kernel on and off in test_ops_kda.py."""

import functools
import json
import math
import os
import pathlib
import stat
import subprocess
import sys

import pytest
import torch

from transformers_k3.ops import cpu_kernel
from transformers_k3.ops import experts as experts_module
from transformers_k3.ops import moe as moe_ops
from transformers_k3.ops.kernel_layers import kernelize
from transformers_k3.modeling_kimi_k3 import K3_GROUPED_MM, KimiK3Experts
from transformers_k3.ops.experts import K3_CPU_KERNEL
from transformers_k3.ops.kda import chunk_kda

from references import assert_close, make_config, make_inputs, randomize, ref_experts


@pytest.fixture(scope="module")
def kernel():
    if cpu_kernel.library() is None:
        pytest.skip(f"fused CPU kernels unavailable: {cpu_kernel.load_error()}")
    return cpu_kernel.library()


_LOADER_RUNS = """
import json, sys
import torch
from transformers_k3.ops import cpu_kernel
if len(sys.argv) > 1:  # a KDA call asking for the kernel, on inputs and to an output file the test names
    from transformers_k3.ops.kda import chunk_kda
    q, k, v, g, beta, h0 = torch.load(sys.argv[1])
    with torch.no_grad():
        torch.save(chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, kernel=True), sys.argv[2])
print(json.dumps({"loaded": cpu_kernel.library() is not None, "error": cpu_kernel.load_error()}), flush=True)
"""


def _fresh_loader(tmp_path, *args, **env):
    """The loader in a fresh process (it builds once per process and keeps the outcome), the kernels' cache in
    ``tmp_path / "cache"`` (empty at first) unless ``env`` says otherwise: ``({"loaded", "error"}, stderr)``."""
    env = {**os.environ, cpu_kernel.CACHE_ENV_VAR: str(tmp_path / "cache"), **env}
    result = subprocess.run([sys.executable, "-c", _LOADER_RUNS, *map(str, args)], capture_output=True, text=True,
                            timeout=900, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_kernel_runs_exactly_where_it_applies(kernel):
    """Asked for (``kernel=True``): fp32 compute (bf16 inputs are promoted) on CPU by the kernel, with or without
    autograd (the same forward bitwise; with it, the gradient is the PyTorch chunked path's, bitwise); not asked:
    the PyTorch chunked path (whose sums differ from the kernel's in order, so the values tell the paths apart)."""
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 16, 16, "k3")
    half = [x.bfloat16() for x in (q, k, v)]
    with torch.no_grad():
        fused, _ = chunk_kda(q, k, v, g, beta, initial_state=h0, kernel=True)
        plain, _ = chunk_kda(q, k, v, g, beta, initial_state=h0)
        fused_half, _ = chunk_kda(*half, g, beta, initial_state=h0, kernel=True)
        promoted, _ = chunk_kda(*(x.float() for x in half), g, beta, initial_state=h0, kernel=True)
    assert not torch.equal(fused, plain)
    assert fused_half.dtype == torch.bfloat16 and torch.equal(fused_half, promoted.bfloat16())
    probe = torch.randn(fused.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for asked in (True, False):
        qs = q.clone().requires_grad_()
        out, _ = chunk_kda(qs, k, v, g, beta, initial_state=h0, kernel=asked)
        assert torch.equal(out.detach(), fused if asked else plain)
        (out * probe).sum().backward()
        grads.append(qs.grad)
    assert torch.equal(*grads)


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_and_packed_sequences_match_fla(kernel, fla_naive, threads):
    """Tasks are (sequence, head) pairs spread over OpenMP threads; sequences of different lengths
    (partial last chunks, an empty one) each give fla's answer, with head dim 128."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v, g, beta, _ = make_inputs(1, 200, 3, 128, 64, "k3", seed=4)
        lengths = [97, 0, 32, 1, 70]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        states = torch.randn(len(lengths), 3, 128, 64, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            o, s = chunk_kda(q, k, v, g, beta, initial_state=states, output_final_state=True, cu_seqlens=cu,
                             kernel=True)
        for i, (start, end) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
            piece = [x[:, start:end] for x in (q, k, v, g, beta)]
            ref_o, ref_s = fla_naive(*piece, initial_state=states[i : i + 1], output_final_state=True)
            assert_close(o[:, start:end], ref_o)
            assert_close(s[i : i + 1], ref_s)
    finally:
        torch.set_num_threads(previous)


def test_factored_and_exact_pairwise_decays_in_one_sequence(kernel, fla_naive):
    """A chunk whose log-decays span more than the factored form allows (|G_r - G_mid| > 80) is computed
    with one exponential per pair; chunks of both kinds follow each other in one sequence and share the
    state."""
    q, k, v, g, beta, h0 = make_inputs(2, 160, 2, 16, 16, "k3", seed=8)
    g = g.clone()
    g[:, 40:72] = -12.0  # chunk 1 (tokens 32..63) partly, chunk 2 (64..95) partly: spans of 12 x 16 = 192
    g[:, 100] = -300.0  # one step that wipes the state in chunk 3
    ref_o, ref_s = fla_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    with torch.no_grad():
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, kernel=True)
    assert_close(o, ref_o)
    assert_close(s, ref_s)


def test_non_finite_inputs_propagate(kernel):
    """A NaN in a chunk's inputs shows up in that sequence's outputs (it is not silently dropped)."""
    q, k, v, g, beta, h0 = make_inputs(2, 64, 1, 8, 8, "k3", seed=2)
    g = g.clone()
    g[1, 10, 0, 3] = float("nan")
    with torch.no_grad():
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, kernel=True)
    assert torch.isfinite(o[0]).all() and torch.isfinite(s[0]).all()
    assert torch.isnan(o[1, 10:]).any() and torch.isnan(s[1]).any()


def test_build_is_cached_and_leaves_no_temporary_files(kernel, built_kernels, tmp_path):
    """A fresh process builds into an empty cache (conftest's `built_kernels`, the session's one build) and leaves the
    library and its checksum there, nothing else; the next fresh process loads that library."""
    cache = built_kernels.cache
    assert built_kernels.loaded, built_kernels.error
    built = built_kernels.files  # the library and the checksum its build recorded, right after the build
    assert len(built) == 2 and built[0].startswith("cpu_kernels_") and built[0].endswith(".so"), built
    assert built[1] == built[0] + ".sha256", built
    loaded, _ = _fresh_loader(tmp_path, **{cpu_kernel.CACHE_ENV_VAR: str(cache)})
    assert loaded["loaded"], loaded["error"]
    assert sorted(os.listdir(cache)) == built
    assert (cache / built[0]).stat().st_mtime_ns == built_kernels.mtime_ns  # loaded, not rebuilt


def test_unusable_cache_builds_in_a_private_temporary_directory(kernel, tmp_path):
    """A cache location that cannot be created (here: below a regular file; read-only home directories fail
    the same way) does not turn the kernels off: they are built in a per-user temporary directory."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    (tmp_path / "tmp").mkdir()
    loaded, _ = _fresh_loader(tmp_path, **{cpu_kernel.CACHE_ENV_VAR: str(blocker / "cache"),
                                           "TMPDIR": str(tmp_path / "tmp")})  # fmt: skip
    assert loaded["loaded"], loaded["error"]
    built = list((tmp_path / "tmp").glob("transformers_k3-*/cpu_kernels_*.so"))
    assert len(built) == 1, built
    assert oct(built[0].parent.stat().st_mode & 0o777) == oct(0o700)


def test_no_compiler_falls_back_to_the_pytorch_path(tmp_path, fla_naive):
    """On a machine without a C++ compiler (none named, none on the path) a KDA call asking for the kernel warns
    once and computes fla's values on the PyTorch path."""
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 16, 16, "k3")
    torch.save((q, k, v, g, beta, h0), tmp_path / "inputs.pt")
    loaded, stderr = _fresh_loader(tmp_path, tmp_path / "inputs.pt", tmp_path / "outputs.pt",
                                   CXX=str(tmp_path / "no-such-compiler"), PATH=str(tmp_path / "empty-bin"))
    assert not loaded["loaded"] and "no C++ compiler found" in loaded["error"]
    assert "using the PyTorch path" in stderr
    o, s = torch.load(tmp_path / "outputs.pt")
    ref_o, ref_s = fla_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close(o, ref_o)
    assert_close(s, ref_s)


def test_failed_build_reports_the_compiler_error(tmp_path):
    script = tmp_path / "broken-cxx"
    script.write_text("#!/bin/sh\necho 'fatal error: simulated' >&2\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    loaded, _ = _fresh_loader(tmp_path, CXX=str(script))
    assert not loaded["loaded"] and "simulated" in loaded["error"]
    assert os.listdir(tmp_path / "cache") == []  # the temporary output was removed


def test_plain_model_is_pytorch_and_kernelize_attaches_the_kernels(tiny_config):
    """The kernels are chosen once, by `kernelize`: a plain model has no kernel in any slot (KDA, MLA attention,
    MoE, router, MLP, RMSNorm, experts) and no KernelLinear, so it computes in PyTorch; kernelize attaches the
    KDA and MLA attention kernels with the others, and ``kernelize(model, False)`` takes every one off again."""
    from transformers_k3 import KimiK3ForCausalLM
    from transformers_k3.ops.linear import KernelLinear

    model = KimiK3ForCausalLM(tiny_config)
    slots = [m for m in model.modules() if getattr(type(m), "k3_kernel_name", None)]
    kinds = {m.k3_kernel_name for m in slots}
    assert {"k3_kda", "k3_mla", "k3_sparse_moe", "k3_rms_norm"} <= kinds
    assert all(m.kernel is None for m in slots)
    assert not any(isinstance(m, KernelLinear) for m in model.modules())
    kernelize(model)
    attached = {m.k3_kernel_name for m in slots if m.kernel is not None}
    assert {"k3_kda", "k3_mla"} <= attached
    kernelize(model, False)
    assert all(m.kernel is None for m in slots)
    assert not any(isinstance(m, KernelLinear) for m in model.modules())


_PLAIN_MODEL_RUNS = """
import torch
from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig, kernelize
model = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()
with torch.no_grad():
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False)
print("PLAIN RAN", flush=True)
"""


def test_a_plain_model_compiles_and_loads_nothing(tmp_path):
    """A model that is not kernelized (prefill and decode steps, fp32 on CPU, where every kernel would apply)
    never builds the kernels: in a fresh process with an empty cache and a compiler that leaves a mark when run."""
    mark = tmp_path / "compiler-ran"
    compiler = tmp_path / "cxx"
    compiler.write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    compiler.chmod(0o755)
    env = {**os.environ, "CXX": str(compiler), cpu_kernel.CACHE_ENV_VAR: str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", _PLAIN_MODEL_RUNS], capture_output=True, text=True, timeout=300,
                            env=env)  # fmt: skip
    assert result.returncode == 0 and "PLAIN RAN" in result.stdout, result.stderr[-3000:]
    assert not mark.exists() and not (tmp_path / "cache").exists()


def test_sources_ship_with_the_package():
    for path in (*cpu_kernel.SOURCES, *cpu_kernel.HEADERS):
        assert pathlib.Path(path).is_file(), path


# --------------------------------------------------------------------------------------------------
# Routed experts


@pytest.fixture(params=["small_gemm", "sgemm"])
def experts_kernel(kernel, request):
    """The experts kernel has two paths: register-blocked products with per-thread accumulators (small
    experts, AVX-512 or AVX2 builds) and sgemm with expert-sorted rows; every experts test runs each, asked for by
    `moe_experts`'s ``small_gemm`` (the value returned here)."""
    if request.param == "small_gemm" and not kernel.small_gemm_available():
        pytest.skip("this build of the kernels has no small-GEMM path (no AVX-512 or AVX2)")
    return request.param == "small_gemm"


def _kernel_output(experts, x, idx, w, small_gemm=None):
    """The experts kernel's own output on these tensors, without autograd (None where it declines), on the path its
    sizes pick or the one ``small_gemm`` asks for: a call that equals it bitwise was computed by the kernel (the
    PyTorch path sums in another order)."""
    with torch.no_grad():
        return cpu_kernel.moe_experts(x, idx, w, experts.gate_up_proj, experts.down_proj, experts.is_transposed,
                                      experts.glu, small_gemm=small_gemm)  # fmt: skip


def _pytorch_experts(experts, x, idx, w):
    """The ``"k3_grouped_mm"`` experts function on the module's weights: the PyTorch path."""
    return experts_module.torch_grouped_experts(experts, x, idx, w, False)


def _routing(num_tokens, top_k, num_experts, seed=3, skip=None):
    gen = torch.Generator().manual_seed(seed)
    choices = [e for e in range(num_experts) if e != skip]
    picks = [torch.randperm(len(choices), generator=gen)[:top_k] for _ in range(num_tokens)]
    idx = torch.tensor(choices)[torch.stack(picks)] if picks else torch.zeros(0, top_k, dtype=torch.long)
    w = torch.rand(num_tokens, top_k, generator=gen)
    return idx, w


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # SiTU with both caps, latent 32
        {"activation_situ_linear_beta": None},
        {"activation_situ_beta": 2.5},  # the general SiTU path (K3's beta = 4 has its own)
        {"hidden_act": "silu"},
        {"routed_expert_hidden_size": None},  # full width 64
        {"routed_expert_hidden_size": 40, "moe_intermediate_size": 12},  # widths no multiple of 16
    ],
)
@pytest.mark.parametrize("shape", [(37, 4), (1, 4), (20, 1), (300, 2)])
def test_experts_kernel_matches_the_per_token_loop(experts_kernel, overrides, shape):
    """Inference through k3_cpu_kernel (the kernel on the path its sizes pick) and through the kernel on each
    path: the output equals the float64 spec loop <= 1e-5 (300 tokens on top-2 of 16 experts gives experts more
    rows than one task takes)."""
    cfg = make_config(num_experts=16, _experts_implementation=K3_CPU_KERNEL, **overrides)
    experts = randomize(KimiK3Experts(cfg))
    num_tokens, top_k = shape
    idx, w = _routing(num_tokens, top_k, 16, skip=3)
    x = torch.randn(num_tokens, experts.hidden_dim, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = experts(x, idx, w)
    assert torch.equal(out, _kernel_output(experts, x, idx, w))
    ref, _ = ref_experts(experts, x, idx, w, torch.zeros(num_tokens, experts.hidden_dim))
    for got in (out, _kernel_output(experts, x, idx, w, small_gemm=experts_kernel)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


# (latent width, intermediate size): the tiny config's, and widths that are no multiple of 16 and differ, so that
# a transposed copy with rows and columns swapped cannot pass
WIDTHS = [(32, 32), (40, 12)]


@pytest.mark.parametrize("width", WIDTHS)
def test_experts_kernel_reads_transposed_weights(experts_kernel, width):
    latent, inter = width
    cfg = make_config(num_experts=16, routed_expert_hidden_size=latent, moe_intermediate_size=inter)
    experts = randomize(KimiK3Experts(cfg))
    idx, w = _routing(40, 4, 16)
    x = torch.randn(40, latent, generator=torch.Generator().manual_seed(6))
    path = {"small_gemm": experts_kernel}
    expected = cpu_kernel.moe_experts(x, idx, w, experts.gate_up_proj.data, experts.down_proj.data, False,
                                      experts.glu, **path)  # fmt: skip
    ref, _ = ref_experts(experts, x, idx, w, torch.zeros(40, latent))
    torch.testing.assert_close(expected.double(), ref, atol=1e-5, rtol=1e-5)
    gate_up_t = experts.gate_up_proj.data.transpose(1, 2).contiguous()
    down_t = experts.down_proj.data.transpose(1, 2).contiguous()
    out = cpu_kernel.moe_experts(x, idx, w, gate_up_t, down_t, True, experts.glu, **path)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    # non-contiguous weights are not copied per call: the caller falls back to the PyTorch path
    assert cpu_kernel.moe_experts(x, idx, w, gate_up_t.transpose(1, 2), down_t, False, experts.glu, **path) is None


def test_experts_kernel_sentinels_and_no_tokens(experts_kernel):
    """Ids outside [0, E) (expert-parallel sentinels) contribute nothing; zero tokens give an empty output."""
    cfg = make_config(num_experts=8)
    experts = randomize(KimiK3Experts(cfg))
    idx, w = _routing(9, 2, 8)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(7))
    args = (experts.gate_up_proj.data, experts.down_proj.data, False, experts.glu)
    path = {"small_gemm": experts_kernel}
    out = cpu_kernel.moe_experts(x, idx, w, *args, **path)
    with_sentinels = cpu_kernel.moe_experts(
        x, torch.cat([idx, torch.full((9, 1), 8), torch.full((9, 1), -1)], 1),
        torch.cat([w, torch.ones(9, 2)], 1), *args, **path,
    )  # fmt: skip
    torch.testing.assert_close(with_sentinels, out, atol=0, rtol=0)
    ref, _ = ref_experts(experts, x, idx, w, torch.zeros(9, 32))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    empty = cpu_kernel.moe_experts(x[:0], idx[:0], w[:0], *args, **path)
    assert empty.shape == (0, 32)


@pytest.fixture(params=["vector", "scalar"])
def glu_form(request, kernel):
    """The kernel's GLUs as 16-lane vectors (glu_simd.h: AVX-512 or AVX2) and as the scalar forms that builds
    without either take (forced here through set_vector_glu)."""
    if request.param == "vector" and not kernel.small_gemm_available():
        pytest.skip("this build has no vector GLUs (no AVX-512 or AVX2)")
    previous = kernel.set_vector_glu(int(request.param == "vector"))
    yield request.param
    kernel.set_vector_glu(previous)


@pytest.mark.parametrize("activation", [("situ", 4.0, 25.0), ("situ", 4.0, None), ("situ", 2.5, 25.0), ("silu",)])
def test_experts_kernel_activation_values_and_gradients(experts_kernel, glu_form, activation):
    """The kernel's GLU, element by element, against the float64 formula: one expert whose gate/up product is the
    identity (gate = x[:16], up = x[16:]) and whose down product copies the GLU out, over gate values from -60 to
    60 (through 0, K3's tanh polynomial/exponential switch at |a| = 2.5 and the tiny values where 1 - e^-x would
    cancel) and up values from -80 to 80 (the up cap's switch at 15.6); outputs <= 2e-6 relative, input gradients
    <= 1e-5."""
    inter = 16
    specials = [0.0, 1e-7, 1e-3, 0.1, 2.4999, 2.5, 2.5001, 5.0, 17.3, 60.0]
    gates = torch.cat([torch.tensor(specials), -torch.tensor(specials), torch.linspace(-60, 60, 1002)])
    gates = gates[: gates.numel() // inter * inter].view(-1, inter)
    ups = torch.linspace(-80, 80, gates.numel()).view(-1, inter)[torch.randperm(gates.shape[0])]
    x = torch.cat([gates, ups], 1).requires_grad_()
    gate_up = torch.eye(2 * inter).unsqueeze(0)
    down = torch.zeros(1, 2 * inter, inter)
    down[0, :inter] = torch.eye(inter)
    n = x.shape[0]
    idx, w = torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1)
    out = cpu_kernel.moe_experts(x, idx, w, gate_up, down, False, activation, small_gemm=experts_kernel)
    probe = torch.randn(n, 2 * inter, generator=torch.Generator().manual_seed(21))
    (out * probe).sum().backward()

    x64 = x.detach().double().requires_grad_()
    a, u = x64[:, :inter], x64[:, inter:]
    if activation[0] == "silu":
        ref = torch.nn.functional.silu(a) * u
    else:
        beta, linear = activation[1], activation[2]
        ref = beta * torch.tanh(a / beta) * torch.sigmoid(a) * (u if linear is None else linear * torch.tanh(u / linear))
    (ref * probe[:, :inter].double()).sum().backward()
    torch.testing.assert_close(out[:, :inter].detach().double(), ref.detach(), atol=1e-6, rtol=2e-6)
    assert (out[:, inter:] == 0).all()
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)


def test_experts_kernel_huge_activations_stay_bounded(experts_kernel):
    """SiTU caps both halves: activations of 1e30 and infinities give the PyTorch path's finite values (the
    module, and the kernel on each path)."""
    cfg = make_config(num_experts=8, _experts_implementation=K3_CPU_KERNEL)
    experts = randomize(KimiK3Experts(cfg))
    idx, w = _routing(6, 2, 8)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(8)) * 1e30
    x[0, 0] = float("inf")
    with torch.no_grad():
        fused = experts(x, idx, w)
        reference = _pytorch_experts(experts, x, idx, w)
    assert torch.equal(fused, _kernel_output(experts, x, idx, w))
    assert torch.isfinite(reference).all()
    torch.testing.assert_close(fused, reference, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(_kernel_output(experts, x, idx, w, experts_kernel), reference, atol=1e-4, rtol=1e-5)


def test_experts_kernel_runs_exactly_where_it_applies(kernel):
    """fp32 weights and inputs, with or without autograd: the kernel; bf16 too where the build has the small-GEMM
    path (the sgemm path declines bf16 weights); under expert parallelism, or through k3_grouped_mm without the
    kernel attached: the PyTorch path (bitwise its values); k3_grouped_mm with the kernel attached (`kernelize`):
    the kernel."""
    cfg = make_config(num_experts=16, _experts_implementation=K3_CPU_KERNEL)
    experts = randomize(KimiK3Experts(cfg))
    idx, w = _routing(37, 4, 16)
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        kernel_out, pytorch_out = _kernel_output(experts, x, idx, w), _pytorch_experts(experts, x, idx, w)
        assert not torch.equal(kernel_out, pytorch_out)  # (the sums' order tells the two apart)
        assert torch.equal(experts(x, idx, w), kernel_out)
        plain = randomize(KimiK3Experts(make_config(num_experts=16, _experts_implementation=K3_GROUPED_MM)))
        plain.load_state_dict(experts.state_dict())
        assert torch.equal(plain(x, idx, w), pytorch_out)
        assert torch.equal(kernelize(plain)(x, idx, w), kernel_out)
        experts._is_expert_parallel = True
        assert torch.equal(experts(x, idx, w), pytorch_out)
        experts._is_expert_parallel = False
        experts.bfloat16()
        bf16_out = experts(x.bfloat16(), idx, w)
        if kernel.small_gemm_available():
            assert torch.equal(bf16_out, _kernel_output(experts, x.bfloat16(), idx, w))
        else:
            assert _kernel_output(experts, x.bfloat16(), idx, w) is None
            assert torch.equal(bf16_out, _pytorch_experts(experts, x.bfloat16(), idx, w))
    out = experts.float()(x, idx, w)  # under autograd too: the kernel has a backward
    assert "moe_experts" in type(out.grad_fn).__name__
    assert torch.equal(out.detach(), _kernel_output(experts, x, idx, w))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"activation_situ_linear_beta": None},
        {"activation_situ_beta": 2.5},
        {"hidden_act": "silu"},
        {"routed_expert_hidden_size": 40, "moe_intermediate_size": 12},
    ],
)
@pytest.mark.parametrize("shape", [(37, 4), (300, 2)])
def test_experts_kernel_backward_matches_the_per_token_loop(experts_kernel, overrides, shape):
    """Gradients of the kernel's backward (input, routing weights, both expert weights; the module's, on the path
    its sizes pick, and the kernel's on each path) equal the float64 spec loop's <= 1e-5; 300 tokens on top-2 of
    16 experts accumulate an expert's weight gradient over several row tiles; expert 3 is never chosen and gets
    exactly zero."""
    cfg = make_config(num_experts=16, _experts_implementation=K3_CPU_KERNEL, **overrides)
    experts = randomize(KimiK3Experts(cfg))
    num_tokens, top_k = shape
    idx, w = _routing(num_tokens, top_k, 16, skip=3)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(num_tokens, experts.hidden_dim, generator=gen).requires_grad_()
    w.requires_grad_()
    probe = torch.randn(num_tokens, experts.hidden_dim, generator=gen)
    out = experts(x, idx, w)
    assert "moe_experts" in type(out.grad_fn).__name__ and torch.equal(out.detach(), _kernel_output(experts, x, idx, w))
    (out * probe).sum().backward()
    _, ref_grads = ref_experts(experts, x, idx, w, probe)
    xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    gate_up = experts.gate_up_proj.detach().clone().requires_grad_()
    down = experts.down_proj.detach().clone().requires_grad_()
    forced = cpu_kernel.moe_experts(xs, idx, ws, gate_up, down, experts.is_transposed, experts.glu,
                                    small_gemm=experts_kernel)  # fmt: skip
    (forced * probe).sum().backward()
    for grads in ((x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad),
                  (xs.grad, ws.grad, gate_up.grad, down.grad)):  # fmt: skip
        for name, g, g_ref in zip(("x", "weights", "gate_up_proj", "down_proj"), grads, ref_grads):
            torch.testing.assert_close(g.double(), g_ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        assert (grads[2][3] == 0).all() and (grads[3][3] == 0).all()


@pytest.mark.parametrize("width", WIDTHS)
def test_experts_kernel_backward_transposed_weights_and_partial_needs(experts_kernel, width):
    """Weights stored [E, in, out] get their gradients in that layout, and the input and routing weights the
    same gradients as with [E, out, in]; only the tensors that require grad get one (the weights alone, as
    with frozen inputs)."""
    latent, inter = width
    cfg = make_config(num_experts=16, routed_expert_hidden_size=latent, moe_intermediate_size=inter)
    experts = randomize(KimiK3Experts(cfg))
    idx, w = _routing(40, 4, 16)
    x = torch.randn(40, latent, generator=torch.Generator().manual_seed(12))
    probe = torch.randn(40, latent, generator=torch.Generator().manual_seed(13))

    def grads(transposed, inputs_need_grad):
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        if transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        gate_up, down = gate_up.contiguous().requires_grad_(), down.contiguous().requires_grad_()
        xs, ws = x.clone().requires_grad_(inputs_need_grad), w.clone().requires_grad_(inputs_need_grad)
        out = cpu_kernel.moe_experts(xs, idx, ws, gate_up, down, transposed, experts.glu, small_gemm=experts_kernel)
        (out * probe).sum().backward()
        if transposed:
            return xs.grad, ws.grad, gate_up.grad.transpose(1, 2), down.grad.transpose(1, 2)
        return xs.grad, ws.grad, gate_up.grad, down.grad

    expected = grads(False, True)
    for got, want in zip(grads(True, True), expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    weights_only = grads(True, False)
    assert weights_only[0] is None and weights_only[1] is None
    for got, want in zip(weights_only[2:], expected[2:]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_experts_kernel_thread_counts_and_repeatability(experts_kernel, threads):
    """Any thread count gives the same outputs and gradients (the small-GEMM path splits the experts among the
    threads and sums per-thread accumulators), and repeating a call gives bitwise the same result."""
    cfg = make_config(num_experts=16)
    experts = randomize(KimiK3Experts(cfg))
    idx, w = _routing(300, 4, 16)
    x = torch.randn(300, 32, generator=torch.Generator().manual_seed(14))
    probe = torch.randn(300, 32, generator=torch.Generator().manual_seed(15))

    def run():
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        gate_up = experts.gate_up_proj.detach().clone().requires_grad_()
        down = experts.down_proj.detach().clone().requires_grad_()
        out = cpu_kernel.moe_experts(xs, idx, ws, gate_up, down, False, experts.glu, small_gemm=experts_kernel)
        (out * probe).sum().backward()
        return out.detach(), xs.grad, ws.grad, gate_up.grad, down.grad

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run()
        torch.set_num_threads(threads)
        first, second = run(), run()
    finally:
        torch.set_num_threads(previous)
    for a, b, c in zip(single, first, second):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
        assert torch.equal(b, c)


def test_experts_kernel_backward_from_saved_products(experts_kernel):
    """On the small-GEMM path the forward keeps the gate/up products and the backward reads them instead of
    recomputing: the same gradients as a backward that recomputes them (``save_products=False``), and both the
    float64 spec loop's <= 1e-5."""
    cfg = make_config(num_experts=16)
    experts = randomize(KimiK3Experts(cfg))
    idx, w = _routing(300, 4, 16)
    x = torch.randn(300, 32, generator=torch.Generator().manual_seed(18))
    probe = torch.randn(300, 32, generator=torch.Generator().manual_seed(19))

    def grads(save_products):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        gate_up = experts.gate_up_proj.detach().clone().requires_grad_()
        down = experts.down_proj.detach().clone().requires_grad_()
        out = cpu_kernel.moe_experts(xs, idx, ws, gate_up, down, False, experts.glu, small_gemm=experts_kernel,
                                     save_products=save_products)  # fmt: skip
        (out * probe).sum().backward()
        return xs.grad, ws.grad, gate_up.grad, down.grad

    expected = grads(True)
    for got, want in zip(grads(False), expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    _, ref_grads = ref_experts(experts, x, idx, w, probe)
    for got, want in zip(expected, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def _bf16_experts_run(experts, x, idx, w, probe, dtype, transposed, save_products=True):
    """The kernel's output and gradients on the small-GEMM path with the operands as ``dtype`` (weights stored
    [E, in, out] if ``transposed``; gradients returned in [E, out, in])."""
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gate_up = gate_up.to(dtype).contiguous().requires_grad_()
    down = down.to(dtype).contiguous().requires_grad_()
    xs, ws = x.to(dtype).detach().requires_grad_(), w.clone().requires_grad_()  # (x itself left as it was)
    out = cpu_kernel.moe_experts(xs, idx, ws, gate_up, down, transposed, experts.glu, small_gemm=True,
                                 save_products=save_products)  # fmt: skip
    (out * probe.to(dtype)).sum().backward()
    grad_gate_up, grad_down = gate_up.grad, down.grad
    if transposed:
        grad_gate_up, grad_down = grad_gate_up.transpose(1, 2), grad_down.transpose(1, 2)
    return out.detach(), xs.grad, ws.grad, grad_gate_up, grad_down


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_experts_kernel_bf16_is_the_fp32_kernel_rounded_once(kernel, transposed, threads):
    """bf16 weights, activations and output gradient (small-GEMM path): the output and every gradient are the
    fp32 kernel's on the operands' exact fp32 copies, rounded to bf16 once, bitwise (the weight gradients of
    each expert summed in fp32 and rounded by the kernel as torch rounds: ties to even); the routing weights
    stay fp32 and their gradient is the fp32 kernel's exactly. Against the float64 loop on the same values, the
    output is within one bf16 rounding. Expert 3, never chosen, gets exact zeros. A backward that recomputes the
    gate/up products gives the same bits as one that reads the forward's."""
    if not kernel.small_gemm_available():
        pytest.skip("bf16 weights take the small-GEMM path only (no AVX-512 or AVX2 here)")
    cfg = make_config(num_experts=16, routed_expert_hidden_size=40, moe_intermediate_size=12)
    experts = randomize(KimiK3Experts(cfg))
    with torch.no_grad():  # weights that are bf16 values, so that the reference sees the same numbers
        for p in experts.parameters():
            p.copy_(p.bfloat16())
    idx, w = _routing(300, 4, 16, skip=3)
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(300, 40, generator=gen).bfloat16().float()
    probe = torch.randn(300, 40, generator=gen).bfloat16().float()
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        low = _bf16_experts_run(experts, x, idx, w, probe, torch.bfloat16, transposed)
        full = _bf16_experts_run(experts, x, idx, w, probe, torch.float32, transposed)
        # a backward that recomputes the gate/up products (the forward saved none) gives the same bits
        recomputed = _bf16_experts_run(experts, x, idx, w, probe, torch.bfloat16, transposed, save_products=False)
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(recomputed, low))
    for name, got, want in zip(("out", "x", "weights", "gate_up_proj", "down_proj"), low, full):
        expected_dtype = torch.float32 if name == "weights" else torch.bfloat16
        assert got.dtype == expected_dtype, name
        assert torch.equal(got, want.to(expected_dtype)), name
    assert (low[3][3] == 0).all() and (low[4][3] == 0).all()
    ref, _ = ref_experts(experts, x, idx, w, probe)
    torch.testing.assert_close(low[0].double(), ref, atol=1e-5, rtol=2**-8)


def test_experts_kernel_bf16_in_the_module_and_where_it_falls_back(kernel):
    """A bf16 KimiK3Experts under k3_grouped_mm with small experts runs the kernel (the small-GEMM path; forward and
    backward) and agrees with the PyTorch path in bf16 (which rounds every product and activation to bf16) to
    bf16 accuracy; where the sgemm path would run (asked for; by default full-size experts) the kernel declines
    bf16 weights and the module's output and gradients are the PyTorch path's, bitwise."""
    if not kernel.small_gemm_available():
        pytest.skip("bf16 weights take the small-GEMM path only (no AVX-512 or AVX2 here)")
    idx, w = _routing(300, 4, 16)

    def run(experts, forward, x, probe):
        experts.zero_grad(set_to_none=True)
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = forward(xs, idx, ws)
        (out * probe).sum().backward()
        return out.detach(), xs.grad, ws.grad, experts.gate_up_proj.grad, experts.down_proj.grad

    for latent, inter in ((32, 32), (256, 272)):  # (3 x 256 x 272 floats: past SMALL_EXPERT_FLOATS)
        cfg = make_config(num_experts=16, _experts_implementation=K3_CPU_KERNEL, routed_expert_hidden_size=latent,
                          moe_intermediate_size=inter)  # fmt: skip
        experts = randomize(KimiK3Experts(cfg)).bfloat16()
        gen = torch.Generator().manual_seed(32 + latent)
        x, probe = (torch.randn(300, latent, generator=gen).bfloat16() for _ in range(2))
        fused = run(experts, experts, x, probe)
        reference = run(experts, functools.partial(_pytorch_experts, experts), x, probe)
        if latent == 32:
            assert torch.equal(fused[0], _kernel_output(experts, x, idx, w))
            for name, got, want in zip(("out", "x", "weights", "gate_up_proj", "down_proj"), fused, reference):
                assert got.dtype == want.dtype, name
                scale = want.float().abs().max()
                torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * scale, rtol=0,
                                           msg=lambda m: f"{name}: {m}")  # fmt: skip
            assert _kernel_output(experts, x, idx, w, small_gemm=False) is None
        else:
            assert _kernel_output(experts, x, idx, w) is None
            for got, want in zip(fused, reference):
                torch.testing.assert_close(got, want, atol=0, rtol=0)  # the PyTorch path itself


def test_experts_small_gemm_path_is_chosen_for_small_experts(kernel):
    """The default: small experts (a transposed copy fits in L2) seeing >= 3 rows each on average take the
    small-GEMM path on AVX-512 and AVX2 builds, unless its per-thread accumulators would outgrow the sorted rows
    (threads - 1 > top-k); decode steps (a token or a few over 896 experts) and K3's full-size experts (latent
    3584, intermediate 3072) go through sgemm. bf16 weights: the small-GEMM path whenever the experts are small."""
    available = bool(kernel.small_gemm_available())
    assert cpu_kernel.experts_small_gemm(128, 32, 16, 2, 2048, 896) is available
    assert cpu_kernel.experts_small_gemm(128, 32, 16, 2, 1, 896) is False
    assert cpu_kernel.experts_small_gemm(128, 32, 2, 4, 2048, 8) is False
    assert cpu_kernel.experts_small_gemm(3584, 3072, 16, 2, 2048, 896) is False
    # bf16 weights (which the sgemm path declines): the small-GEMM path for small experts at any token count
    assert cpu_kernel.experts_small_gemm(128, 32, 16, 2, 1, 896, bf16=True) is available
    assert cpu_kernel.experts_small_gemm(128, 32, 2, 4, 2048, 8, bf16=True) is available
    assert cpu_kernel.experts_small_gemm(3584, 3072, 16, 2, 2048, 896, bf16=True) is False


# --------------------------------------------------------------------------------------------------
# Router top-k


@pytest.mark.parametrize("top_k", [1, 5, 16, 17])
@pytest.mark.parametrize("num_experts", [17, 31, 40, 896])
def test_router_topk_matches_torch_topk(kernel, num_experts, top_k):
    """The k largest biased scores in torch.topk's (sorted) order, for k in and beyond one register (16), rows
    not a multiple of 16 experts (lanes holding one expert: the first pass's floor from each lane's two largest
    must not count the missing second), several threads."""
    gen = torch.Generator().manual_seed(num_experts + top_k)
    scores = torch.rand(300, num_experts, generator=gen)
    bias = torch.randn(num_experts, generator=gen) * 0.05
    expected = torch.topk(scores + bias, top_k, dim=-1).indices
    previous = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(cpu_kernel.router_topk(scores, bias, top_k), expected)
    finally:
        torch.set_num_threads(previous)


def test_router_topk_rows_of_fewer_than_16_experts(kernel):
    """Rows shorter than one register (lanes without experts), every k up to the row length."""
    gen = torch.Generator().manual_seed(17)
    for num_experts in (1, 5, 16):
        scores, bias = torch.rand(40, num_experts, generator=gen), torch.randn(num_experts, generator=gen) * 0.05
        for top_k in range(1, num_experts + 1):
            expected = torch.topk(scores + bias, top_k, dim=-1).indices
            assert torch.equal(cpu_kernel.router_topk(scores, bias, top_k), expected), (num_experts, top_k)


@pytest.mark.parametrize("top_k", [3, 17])
def test_router_topk_ties_nan_and_infinities(kernel, top_k):
    """Equal biased scores rank the lower expert id first (all-equal rows give experts 0 .. k-1); NaN ranks
    above every number and -inf below, as in torch.topk; a row of -inf still yields k distinct experts."""
    num_experts = 40
    scores = torch.zeros(4, num_experts)
    scores[1, [7, 30, 33]] = 2.0  # a tie above the rest
    scores[2, 25] = float("nan")
    scores[2, 5] = float("-inf")
    scores[3] = float("-inf")
    index = cpu_kernel.router_topk(scores, torch.zeros(num_experts), top_k)
    assert index[0].tolist() == list(range(top_k))
    assert index[1, :3].tolist() == [7, 30, 33] and index[1, 3:].tolist() == [e for e in range(num_experts)
                                                                                if e not in (7, 30, 33)][: top_k - 3]
    assert index[2, 0] == 25 and 5 not in index[2].tolist()
    assert index[3].tolist() == list(range(top_k))
    reference = torch.topk(scores[2:3], top_k, dim=-1).indices
    assert reference[0, 0] == 25  # torch.topk agrees on NaN


def _reference_topk(values: torch.Tensor, top_k: int) -> list[list[int]]:
    """Each row's k best by the documented order, in Python: NaN first (in id order), then descending values,
    equal values by the lower id."""
    return [sorted(range(len(row)), key=lambda e: (not math.isnan(row[e]), -row[e] if not math.isnan(row[e]) else 0,
                                                    e))[:top_k] for row in values.tolist()]  # fmt: skip


@pytest.mark.parametrize("top_k", [2, 16, 32, 33, 70])
@pytest.mark.parametrize("num_experts", [37, 896])
def test_router_topk_many_ties_nans_and_large_k(kernel, num_experts, top_k):
    """Rows full of ties (scores on a coarse grid, so the floor pass's lanes hold equal values and the k-th is
    shared by many experts), NaN in some rows (and enough NaN in one that the k-th itself is NaN), infinities,
    and k beyond the 32 values a floor is taken from (then every expert is looked at): the documented order,
    against a reference written out in Python (k = 70 on 37 experts: k = E, every expert)."""
    top_k = min(top_k, num_experts)
    gen = torch.Generator().manual_seed(num_experts + 7 * top_k)
    scores = torch.randint(0, 6, (24, num_experts), generator=gen).float() / 4
    bias = (torch.randint(0, 3, (num_experts,), generator=gen).float() - 1) / 8
    scores[1, torch.randperm(num_experts, generator=gen)[:5]] = float("nan")
    scores[2, : min(num_experts, top_k + 3)] = float("nan")  # the k-th best is NaN
    scores[3, ::3] = float("inf")
    scores[4, ::2] = float("-inf")
    scores[5] = float("-inf")
    index = cpu_kernel.router_topk(scores, bias, top_k)
    assert index.tolist() == _reference_topk(scores + bias, top_k)


@pytest.mark.parametrize("top_k", [1, 5, 16])
@pytest.mark.parametrize("num_experts", [17, 40, 896])
def test_router_sigmoid_topk_is_torch_sigmoid_then_the_top_k(kernel, num_experts, top_k):
    """The fused sigmoid + selection: bitwise torch.sigmoid's scores at the chosen experts and the ranking of
    router_topk on torch.sigmoid's scores (itself torch.topk's, above), on 1 and 3 threads, with NaN and infinite
    logits; k > 16 is left to router_topk (None)."""
    if not kernel.sigmoid_available():
        pytest.skip("this build has no fused sigmoid (neither AVX-512 nor AVX2, or no Sleef exp in torch)")
    gen = torch.Generator().manual_seed(num_experts * 31 + top_k)
    logits = torch.randn(64, num_experts, generator=gen) * 4
    logits[3, 2], logits[4, 0], logits[4, 1], logits[5] = float("nan"), float("inf"), float("-inf"), float("-inf")
    bias = torch.randn(num_experts, generator=gen) * 0.05
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # (64 x E is a multiple of 32: torch's vectorised loop covers every element)
        scores = torch.sigmoid(logits)
        expected = cpu_kernel.router_topk(scores, bias, top_k)
        for threads in (1, 3):
            torch.set_num_threads(threads)
            index, selected = cpu_kernel.router_sigmoid_topk(logits, bias, top_k)
            assert torch.equal(index, expected)
            assert cpu_kernel.same_bits(selected, scores.gather(1, index))
    finally:
        torch.set_num_threads(previous)
    assert index[3, 0] == 2  # NaN first
    assert cpu_kernel.router_sigmoid_topk(logits, bias, 17) is None


@pytest.mark.parametrize("hidden", [40, 200])
def test_router_sparse_backward_matches_dense_autograd(kernel, hidden):
    """selected_scores' backward (k3_router_backward) against autograd through the dense sigmoid scores: widths
    that are no multiple of 16 or 64, experts no token chose (zero weight-gradient rows), 1 and 3 threads giving
    bitwise the same gradients."""
    gen = torch.Generator().manual_seed(hidden)
    num_tokens, num_experts, top_k = 70, 37, 5
    h, weight = torch.randn(num_tokens, hidden, generator=gen), torch.randn(num_experts, hidden, generator=gen) * 0.2
    index = torch.stack([torch.randperm(30, generator=gen)[:top_k] for _ in range(num_tokens)])  # experts >= 30 unused
    probe = torch.randn(num_tokens, top_k, generator=gen)

    hd, wd = h.clone().requires_grad_(), weight.clone().requires_grad_()
    (torch.sigmoid(hd @ wd.t()).gather(1, index) * probe).sum().backward()
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            hs, ws = h.clone().requires_grad_(), weight.clone().requires_grad_()
            selected = torch.sigmoid(h @ weight.t()).gather(1, index)
            (cpu_kernel.selected_scores(hs, ws, index, selected) * probe).sum().backward()
            results.append((hs.grad, ws.grad))
    finally:
        torch.set_num_threads(previous)
    for got, want in zip(results[0], (hd.grad, wd.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert (results[0][1][30:] == 0).all() and results[0][1][:30].abs().sum() > 0


def test_router_uses_the_kernels_and_agrees_with_torch_topk(kernel, monkeypatch):
    """A kernelized KimiK3Router on CPU, with and without autograd, with the kernels' sigmoid and (as on a torch whose
    sigmoid differs from it) torch's: the same experts and weights as with the kernels off; under autograd the
    gradients for the input and the router weight are the dense path's (<= 1e-5), and the returned logits keep
    their own graph (an auxiliary loss on them still reaches the router); grouped routing gives the kernels-off
    router's experts and weights."""
    from references import make_config as moe_config
    from transformers_k3.modeling_kimi_k3 import KimiK3Router

    router = kernelize(KimiK3Router(moe_config(num_experts=64, num_experts_per_tok=6)))
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.normal_(std=0.1)
    gen = torch.Generator().manual_seed(16)
    x = torch.randn(50, router.hidden_size, generator=gen)
    probe, logit_probe = torch.randn(50, 6, generator=gen), torch.randn(50, 64, generator=gen)

    def run():
        router.weight.grad = None
        xs = x.clone().requires_grad_()
        logits, weights, index = router(xs)
        order = index.sort(-1)
        (weights.gather(1, order.indices) * probe).sum().backward(retain_graph=True)
        grads = (xs.grad.clone(), router.weight.grad.clone())
        (logits * logit_probe).sum().backward()  # as an auxiliary loss on the recorded logits would
        return order.values, weights.gather(1, order.indices).detach(), grads, router.weight.grad.clone()

    kernelize(router, False)
    ref_index, ref_weights, ref_grads, ref_aux = run()
    kernelize(router)
    # the fused sigmoid + selection, and (as where it cannot run) torch's sigmoid + the top-k kernel
    for sigmoid_in_kernel in (True, False):
        # why: simulates a torch build whose sigmoid is not the kernels' bit for bit (the router then ranks torch's)
        monkeypatch.setattr(cpu_kernel, "_sigmoid_matches_torch", lambda lib: sigmoid_in_kernel)
        index, weights, grads, aux = run()
        assert torch.equal(index, ref_index)
        # (the renormalising sum adds the k scores in another order: the kernel lists them in descending order)
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert got.abs().sum() > 0
        torch.testing.assert_close(aux, ref_aux, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            _, weights_no_grad, index_no_grad = router(x)
        assert torch.equal(index_no_grad.sort(-1).values, ref_index)
    grouped = kernelize(KimiK3Router(moe_config(num_experts=64, num_experts_per_tok=6, num_expert_group=4,
                                                topk_group=2)))  # fmt: skip
    grouped.load_state_dict(router.state_dict())
    with torch.no_grad():
        _, grouped_weights, grouped_index = grouped(x)
        kernelize(grouped, False)
        _, plain_weights, plain_index = grouped(x)
    got, want = grouped_index.sort(-1), plain_index.sort(-1)
    assert torch.equal(got.values, want.values)
    torch.testing.assert_close(grouped_weights.gather(1, got.indices), plain_weights.gather(1, want.indices),
                               atol=1e-6, rtol=1e-6)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# bf16 x bf16 -> fp32 GEMM on the AMX tile unit (a bf16 model's router logits)


@pytest.fixture
def amx(kernel):
    if not cpu_kernel.amx_available():
        pytest.skip("no AMX tile unit (bf16) on this CPU or build")


def _fp32_sum_bound(a, b):
    """Worst-case error of summing the K exact products of each output in fp32 in any order: K * 2^-24 *
    sum |products| (float64)."""
    return (a.double().abs() @ b.double().abs().t()) * a.shape[1] * 2.0**-24


# (M, N, K): the router's prefill and decode shapes; tile edges in every dimension; fewer than 12 rows (AVX-512 dot
# products) with k no multiple of 16; no rows
LINEAR_SHAPES = [(2048, 896, 256), (1, 896, 256), (37, 40, 50), (100, 17, 31), (33, 64, 64), (3, 40, 50),
                 (11, 17, 31), (12, 17, 31), (0, 8, 32)]  # fmt: skip


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_linear_bf16_f32_is_an_fp32_sum_of_exact_products(amx, shape):
    """linear_bf16_f32 on bf16 operands (edges in every dimension: rows and columns no multiple of 32, k no
    multiple of 32; fewer than 12 rows; none): against the float64 product, within the bound of any fp32
    summation order, like F.linear on fp32 copies; and within 1e-5 relative of that fp32 GEMM."""
    m, n, k = shape
    gen = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, k, generator=gen).bfloat16()
    out = cpu_kernel.linear_bf16_f32(a, b)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    exact, bound = a.double() @ b.double().t(), _fp32_sum_bound(a, b)
    assert ((out.double() - exact).abs() <= bound).all()
    fp32 = torch.nn.functional.linear(a.float(), b.float())
    assert ((fp32.double() - exact).abs() <= bound).all()
    torch.testing.assert_close(out, fp32, atol=1e-5, rtol=1e-5)


def test_linear_bf16_f32_gradients_and_where_it_declines(amx):
    """Under autograd the input and weight gradients are bitwise the PyTorch path's (F.linear on fp32 copies:
    fp32 products, rounded to bf16); fp32 operands and mixed dtypes give None."""
    gen = torch.Generator().manual_seed(40)
    a = torch.randn(70, 48, generator=gen).bfloat16()
    b = torch.randn(24, 48, generator=gen).bfloat16()
    probe = torch.randn(70, 24, generator=gen)
    grads = []
    for fn in (cpu_kernel.linear_bf16_f32, lambda x, w: torch.nn.functional.linear(x.float(), w.float())):
        xs, ws = a.clone().requires_grad_(), b.clone().requires_grad_()
        (fn(xs, ws) * probe).sum().backward()
        grads.append((xs.grad, ws.grad))
    for got, want in zip(*grads):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert cpu_kernel.linear_bf16_f32(a.float(), b.float()) is None
    assert cpu_kernel.linear_bf16_f32(a, b.float()) is None


@pytest.mark.parametrize("tokens", [300, 3])
def test_bf16_router_logits_on_the_tile_unit(amx, tokens):
    """A kernelized bf16 KimiK3Router's fp32 logits are linear_bf16_f32's (the tile unit for 300 tokens, dot
    products for 3): within the fp32-summation bound of the float64 logits (as the kernels-off path's F.linear on
    fp32 copies is), and the same experts chosen; a router kept in fp32 (`router_fp32`) on bf16 inputs gets
    F.linear's logits on fp32 copies (its weight is no bf16 value)."""
    from references import make_config as moe_config
    from transformers_k3.modeling_kimi_k3 import KimiK3Router

    router = kernelize(KimiK3Router(moe_config(num_experts=64, num_experts_per_tok=6)))
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(42))
    router.bfloat16()
    x = torch.randn(tokens, router.hidden_size, generator=torch.Generator().manual_seed(41)).bfloat16()
    logits, weights, index = router(x)
    assert torch.equal(logits, cpu_kernel.linear_bf16_f32(x, router.weight))
    exact = x.double() @ router.weight.double().t()
    assert ((logits.double() - exact).abs() <= _fp32_sum_bound(x, router.weight)).all()
    kernelize(router, False)
    ref_logits, ref_weights, ref_index = router(x)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    # the same experts, except where the k-th and (k+1)-th biased scores are within the logits' rounding (two fp32
    # sums of the same products may order a near-tie either way: 1 router in 200 random ones here has one)
    biased = (ref_logits.sigmoid() + router.e_score_correction_bias).sort(-1, descending=True).values
    clear = biased[:, 5] - biased[:, 6] > 1e-5
    assert clear.float().mean() > 0.99
    assert torch.equal(index.sort(-1).values[clear], ref_index.sort(-1).values[clear])
    kept = kernelize(KimiK3Router(moe_config(num_experts=64, num_experts_per_tok=6, router_fp32=True)))
    torch.nn.init.normal_(kept.weight, std=0.5, generator=torch.Generator().manual_seed(43))
    assert kept.weight.dtype == torch.float32
    kept_logits, _, _ = kept(x)
    assert torch.equal(kept_logits, torch.nn.functional.linear(x.float(), kept.weight))


# --------------------------------------------------------------------------------------------------
# The fp32 router's screened selection (bf16 tile-unit logits with an error bound, exact fp32 for candidates)


def _screened(x, weight, bias, top_k, screen=True):
    out = cpu_kernel.router_screened_topk(x, weight, bias, top_k, screen=screen)
    assert out is not None
    return out


# (tokens, experts, hidden, k): K3's scaled-down router; tile edges everywhere (tokens no multiple of 32, experts no
# multiple of 16, hidden no multiple of 32); k = E; one token (a decode step); no tokens; a wide input (the bound's
# summation terms grow with the width)
SCREEN_SHAPES = [(2048, 896, 256, 16), (70, 50, 40, 7), (33, 17, 34, 16), (5, 16, 64, 16), (1, 896, 256, 16),
                 (0, 8, 32, 3), (64, 128, 2048, 8)]  # fmt: skip


@pytest.mark.parametrize("shape", SCREEN_SHAPES)
def test_router_screened_topk_is_the_fp32_selection(amx, shape):
    """router_screened_topk, which computes exact fp32 logits only for the experts that its bound cannot rule out,
    against the same kernel with every logit computed in fp32 (screen=False): bitwise the same experts, order and
    scores, on 1 and 3 threads (rows of very different scales: the bound is per token); and against the GEMM path
    (router_sigmoid_topk on F.linear's logits): the same experts wherever the k-th and (k+1)-th biased scores are
    not within fp32 rounding of each other, scores within 1e-5 (rows scaled up to 1e3: logits of ~1e3 differ by
    ~1e-4 between two fp32 sums)."""
    n, e, h, k = shape
    gen = torch.Generator().manual_seed(n + e + h + k)
    x = torch.randn(n, h, generator=gen) * torch.logspace(-3, 3, n or 1)[:n, None]
    weight, bias = torch.randn(e, h, generator=gen) / h**0.5, torch.randn(e, generator=gen) * 0.05
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            results += [_screened(x, weight, bias, k), _screened(x, weight, bias, k, screen=False)]
    finally:
        torch.set_num_threads(previous)
    index, scores = results[0]
    assert index.shape == scores.shape == (n, k) and index.dtype == torch.int64
    for other_index, other_scores in results[1:]:
        assert torch.equal(other_index, index) and cpu_kernel.same_bits(other_scores, scores)
    ref_index, ref_scores = cpu_kernel.router_sigmoid_topk(torch.nn.functional.linear(x, weight), bias, k)
    biased = (torch.sigmoid(x.double() @ weight.double().t()) + bias.double()).sort(-1, descending=True).values
    clear = biased[:, k - 1] - biased[:, k] > 1e-6 if k < e else torch.ones(n, dtype=torch.bool)
    assert clear.float().mean() > 0.99 if n > 100 else clear.all()
    assert torch.equal(index[clear], ref_index[clear])
    torch.testing.assert_close(scores[clear], ref_scores[clear], atol=1e-5, rtol=0)


@pytest.mark.parametrize("bias_kind", ["spread", "wide", "shifted", "one_huge", "huge", "zero"])
@pytest.mark.parametrize("logit_scale", [0.1, 1.0, 3.0, 10.0])
def test_router_screened_topk_any_bias_and_logit_scale(amx, bias_kind, logit_scale):
    """The screen's floor and its cheap pre-check (an upper bound of s(up) against floor - bias - margin) hold
    whatever the bias: spread like a trained router's (0.1), wider than the scores (1, 10), all shifted far below
    zero, one expert's ~1e3 above the rest, all ~1e6 (the margin then exceeds the scores), zero; and logits small
    or saturating the sigmoid: bitwise the selection with every logit in fp32."""
    gen = torch.Generator().manual_seed(11)
    n, e, h, k = 300, 200, 64, 8
    x = torch.randn(n, h, generator=gen) * logit_scale
    weight = torch.randn(e, h, generator=gen) / h**0.5
    noise = torch.randn(e, generator=gen)
    bias = {"spread": noise * 0.1, "wide": noise * torch.tensor([1.0, 10.0]).repeat(e // 2),
            "shifted": noise * 0.05 - 5.0, "one_huge": torch.where(torch.arange(e) == 7, 1e3, noise * 0.01),
            "huge": noise * 1e6, "zero": torch.zeros(e)}[bias_kind]  # fmt: skip
    index, scores = _screened(x, weight, bias, k)
    ref_index, ref_scores = _screened(x, weight, bias, k, screen=False)
    assert torch.equal(index, ref_index) and cpu_kernel.same_bits(scores, ref_scores)
    if bias_kind == "one_huge":
        assert (index[:, 0] == 7).all()


@pytest.mark.parametrize("flush_denormal", [False, True])
def test_router_screened_topk_extreme_biases_few_experts_and_flush_to_zero(amx, flush_denormal):
    """The screen's edge paths, bitwise the selection with every logit in fp32: biases near fp32's range (the key
    down + 4 b overflows to +-inf, the ceiling b + m rounded up to +inf, the lower end b - m to -inf, so the first
    floor is -inf), +-1e30 (b + m rounds), 1 or 2 experts, k = E or 16; subnormal inputs against weights ~1e30 and the
    reverse (the bound's 2^-126 per product); and all of it with flush-to-zero / denormals-are-zero set, as other
    code may leave them."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(37, 34, generator=gen) * 4
    x[3], x[4, ::2], x[5] = 0.0, 1e-39, x[5] * 1e-39
    big = torch.finfo(torch.float32).max
    biases = [torch.full((17,), big), -torch.rand(17, generator=gen) * big, torch.tensor([1e30, -1e30]).repeat(9)[:17],
              torch.where(torch.arange(17) % 3 == 0, -big, torch.randn(17, generator=gen) * 0.1)]  # fmt: skip
    if flush_denormal and not torch.set_flush_denormal(True):
        pytest.skip("flush-to-zero is not supported on this CPU")
    try:
        for e in (1, 2, 17):
            weight = torch.randn(e, 34, generator=gen) / 6
            for bias in biases:
                for k in sorted({1, min(e, 16)}):
                    for xs, ws in ((x, weight), (x * 1e-39, weight * 1e30), (x * 1e30, weight * 1e-39)):
                        index, scores = _screened(xs, ws, bias[:e].contiguous(), k)
                        ref_index, ref_scores = _screened(xs, ws, bias[:e].contiguous(), k, screen=False)
                        assert torch.equal(index, ref_index) and cpu_kernel.same_bits(scores, ref_scores)
    finally:
        torch.set_flush_denormal(False)  # (torch's default; it has no getter)


def test_router_screened_topk_ties_are_torchs(amx):
    """Logits that every fp32 sum gets exactly (small multiples of powers of two, so also exact in bf16), with many
    equal values: the screen must keep every tied expert, and the result is bitwise router_topk's on torch.sigmoid
    of the exact logits (equal biased scores rank the lower expert id first, as torch.topk)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(-2, 3, (300, 64), generator=gen).float() / 4
    weight = torch.randint(-1, 2, (96, 64), generator=gen).float() / 8
    bias = torch.randint(-1, 2, (96,), generator=gen).float() / 64
    logits = x @ weight.t()
    assert torch.equal(logits.double(), x.double() @ weight.double().t())  # exact
    scores = torch.sigmoid(logits)
    expected = cpu_kernel.router_topk(scores, bias, 9)
    biased = scores + bias
    kth = biased.gather(1, expected[:, -1:])
    assert ((biased == kth).sum(-1) > 1).float().mean() > 0.3  # (ties at the boundary are common)
    index, selected = _screened(x, weight, bias, 9)
    assert torch.equal(index, expected) and cpu_kernel.same_bits(selected, scores.gather(1, index))


def test_router_screened_topk_rows_it_cannot_bound_and_where_it_declines(amx):
    """Rows with NaN, an infinity or products near fp32's range, and tiny rows, are the GEMM path's selection (NaN
    ranks first, as torch.topk). A weight or bias with a value that is not finite, k > 16, fp32-only arguments, an
    odd hidden size give None. Nothing is cached between calls: an in-place change
    through ``.data`` (which bumps no version counter) is seen by the next call."""
    gen = torch.Generator().manual_seed(8)
    x, weight = torch.randn(40, 32, generator=gen), torch.randn(24, 32, generator=gen) / 6
    bias = torch.randn(24, generator=gen) * 0.05
    x[3, 5], x[4, 0], x[5], x[7] = float("nan"), float("inf"), x[5] * 1e30, x[7] * 1e-30
    x[8, :16] = 1e-41  # (subnormal)
    index, selected = _screened(x, weight, bias, 4)
    ref_index, ref_selected = cpu_kernel.router_sigmoid_topk(torch.nn.functional.linear(x, weight), bias, 4)
    assert torch.equal(index[3:9], ref_index[3:9]) and cpu_kernel.same_bits(selected[3:9], ref_selected[3:9])
    assert torch.equal(index[3], torch.arange(4))  # all NaN: the first four

    parameter = torch.nn.Parameter(weight.clone())
    first = _screened(x[9:], parameter, bias, 4)
    version = parameter._version
    parameter.data.mul_(-1)  # (the same storage; no new version)
    assert parameter._version == version
    second = _screened(x[9:], parameter, bias, 4)
    assert not torch.equal(first[0], second[0])
    assert torch.equal(second[0], _screened(x[9:], -weight, bias, 4)[0])
    with torch.inference_mode():
        assert torch.equal(_screened(x[9:], weight.clone(), bias, 4)[0], first[0])

    bad = weight.clone()
    bad[2, 3] = float("nan")
    assert cpu_kernel.router_screened_topk(x, bad, bias, 4) is None
    assert cpu_kernel.router_screened_topk(x, weight, bias.clone().fill_(float("inf")), 4) is None
    assert cpu_kernel.router_screened_topk(x, weight, bias, 17) is None
    assert cpu_kernel.router_screened_topk(x[:, :31], weight[:, :31], bias, 4) is None
    assert cpu_kernel.router_screened_topk(x.bfloat16(), weight.bfloat16(), bias, 4) is None
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernel.router_screened_topk(x, weight[:, :30], bias, 4)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernel.router_screened_topk(x, weight, bias[:20], 4)


def test_router_screened_topk_tiny_rows_keep_their_bound(amx):
    """A row of values ~1e-21 against weights ~1e21 (O(1) logits): the row's norms, whose squares are below fp32's
    range, must not vanish from the bound. x's entries round to 1.0 x scale in bf16 with the largest residuals, so
    the approximate logit of expert 0 is 0 where the exact one is 0.74, and expert 1 (logit 0, bias 0.1) would win
    if the bound were ~0 (it did, with the norms summed in fp32: found by review)."""
    hidden = 256
    sign = torch.tensor([1.0, -1.0]).repeat(hidden // 2)
    row = torch.where(sign > 0, torch.tensor(1 + 0.99 * 2**-8), torch.tensor(1 - 0.99 * 2**-9))
    weight = torch.zeros(4, hidden)
    weight[0] = sign
    bias = torch.tensor([0.0, 0.1, 0.0, 0.0])
    for power in (0, 40, 70, 80):
        scale = 2.0**-power
        x, w = (row * scale).expand(32, hidden).contiguous(), weight / scale
        index, selected = _screened(x, w, bias, 1)
        assert (index == 0).all(), power
        assert torch.equal(index, _screened(x, w, bias, 1, screen=False)[0])


def test_moe_layer_selects_with_the_screen_unless_the_logits_are_read(amx):
    """A kernelized KimiK3SparseMoE in fp32 (whose router screens its selection: no [N, E] GEMM): the layer's output
    and its gradients (input, router weight, experts) match the kernels-off path (<= 1e-5). The router gives its
    logits (F.linear's) whenever they are read: called directly, under a forward hook, while Quantile Balancing
    observes it; asked for the selection alone it gives none (screened) once nobody reads them again."""
    from references import make_config as moe_config
    from transformers_k3.modeling_kimi_k3 import KimiK3SparseMoE

    layer = KimiK3SparseMoE(moe_config(num_experts=48, num_experts_per_tok=6, _experts_implementation=K3_GROUPED_MM))
    kernelize(randomize(layer, seed=9))
    layer.gate.e_score_correction_bias.normal_(std=0.05, generator=torch.Generator().manual_seed(3))
    tokens = moe_ops.SCREEN_MIN_TOKENS + 8
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(10))
    dense = torch.nn.functional.linear(x.reshape(tokens, 64), layer.gate.weight).detach()

    def run():
        layer.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        out = layer(xs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), xs.grad, layer.gate.weight.grad, layer.experts.gate_up_proj.grad

    got = run()
    kernelize(layer, False)
    want = run()
    kernelize(layer)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    with torch.no_grad():
        assert layer.gate(x, need_logits=False)[0] is None  # the selection alone: screened
        logits, _, _ = layer.gate(x)  # a direct call: the logits
    torch.testing.assert_close(logits, dense, atol=1e-5, rtol=1e-5)
    seen = []
    handle = layer.gate.register_forward_hook(lambda module, args, output: seen.append(output[0]))
    with torch.no_grad():
        kernelize(layer)(x)  # (a hook present when the kernels are attached: the router keeps its own forward)
    handle.remove()
    torch.testing.assert_close(seen[0], dense, atol=1e-5, rtol=1e-5)
    from transformers_k3 import RouterBalancer

    kernelize(layer)
    with RouterBalancer(layer, router_class=type(layer.gate)), torch.no_grad():
        layer.train()
        layer(x)  # (Quantile Balancing's hooks, attached after kernelize, read the logits)
        layer.eval()
        observed = layer.gate(x, need_logits=False)[0]
    torch.testing.assert_close(observed, dense, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert layer.gate(x, need_logits=False)[0] is None
        torch.testing.assert_close(layer(x), want[0], atol=1e-5, rtol=1e-5)


def test_model_records_router_logits_with_the_screen_on(amx):
    """A kernelized model (whose fp32 routers screen their selection) asked for ``output_router_logits`` returns
    every MoE layer's [N, E] logits, those of the kernels-off path (<= 1e-5); asked again, and without them, the
    same values."""
    from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig

    torch.manual_seed(0)
    model = kernelize(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval())
    ids = torch.randint(0, model.config.vocab_size, (1, moe_ops.SCREEN_MIN_TOKENS + 8))
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
        kernelize(model, False)
        ref = model(ids, output_router_logits=True)
        kernelize(model)
    assert len(out.router_logits) == len(ref.router_logits) > 0
    for a, b in zip(out.router_logits, ref.router_logits):
        assert a.shape == (ids.shape[1], model.config.num_experts)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        again = model(ids, output_router_logits=True)
        plain = model(ids)
    for a, b in zip(again.router_logits, ref.router_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain.logits, ref.logits, atol=1e-5, rtol=1e-5)


@pytest.fixture
def linear_bf16(kernel):
    if not kernel.linear_bf16_available():
        pytest.skip("this build has no bf16 few-row linear (no AVX-512 or AVX2)")


# (rows, N, K): a decode step's shapes (K no multiple of 16 or 32, N no multiple of 16, one output, K = 1), up to 15
# rows (row groups of 4, 2 and 1), larger products on 4 and on 9 rows, 40 and 34 rows in calls of up to 15 (those
# three taken on a CPU without bf16 instructions, as here), and leading dimensions kept
LINEAR_BF16_SHAPES = [((1, 256), 128), ((1, 1, 256), 1), ((3, 37), 100), ((15, 16), 17), ((2, 3, 300), 33),
                      ((7, 1), 5), ((1, 64), 2000), ((0, 32), 8), ((4, 1000), 300), ((9, 1100), 1000),
                      ((40, 300), 70), ((2, 17, 64), 33)]  # fmt: skip


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", LINEAR_BF16_SHAPES)
def test_linear_bf16_rows_is_one_rounding_of_an_fp32_sum(linear_bf16, shape, with_bias):
    """linear_bf16 on bf16 operands (every row count it takes on a CPU without bf16 instructions): every output is
    the float64 value of x w^T + b, summed in fp32 in some order (within K 2^-24 sum |products|) and rounded to bf16
    once (to nearest: within half a bf16 ulp); and it is torch's bf16 F.linear except where the two fp32 sums round
    a near-tie apart (one bf16 ulp, both within the bound)."""
    x_shape, n = shape
    x, w, b = _bf16_linear_operands(x_shape, n, with_bias)
    out = cpu_kernel.linear_bf16(x, w, b, native_bf16=False)
    _assert_one_rounding_of_an_fp32_sum(out, x, w, b)


def _bf16_linear_operands(x_shape, n, with_bias):
    """bf16 ``x [*x_shape]``, ``w [n, K]`` and (``with_bias``) ``b [n]``, seeded by the shape."""
    gen = torch.Generator().manual_seed(sum(x_shape) + n)
    x = torch.randn(x_shape, generator=gen).bfloat16()
    w = torch.randn(n, x_shape[-1], generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    return x, w, b


def _assert_one_rounding_of_an_fp32_sum(out, x, w, b):
    """``out`` is a bf16 ``F.linear(x, w, b)`` of the right shape, each output the float64 value summed in fp32 in
    some order (within K 2^-24 sum |products|) and rounded to bf16 once (within half a bf16 ulp); torch's bf16
    F.linear differs only where the two fp32 sums round a near-tie apart (one bf16 ulp, both within the bound), on
    at most 1 % of the outputs."""
    n, k = w.shape
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == (*x.shape[:-1], n)
    x2 = x.reshape(-1, k)
    exact = x2.double() @ w.double().t() + (0 if b is None else b.double())
    bound = _fp32_sum_bound(x2, w) + (0 if b is None else b.double().abs() * 2.0**-24)
    # half a bf16 ulp (8 significant bits) at the largest value the fp32 sum can take
    half_ulp = torch.exp2(torch.floor(torch.log2(exact.abs() + bound)) - 8)
    err = (out.reshape(-1, n).double() - exact).abs()
    assert (err <= half_ulp + bound).all()
    ref = torch.nn.functional.linear(x, w, b).reshape(-1, n)
    differ = out.reshape(-1, n) != ref
    assert ((ref.double() - exact).abs()[differ] <= 2 * half_ulp[differ] + bound[differ]).all()
    if differ.numel():
        assert differ.float().mean() <= 0.01


def test_linear_bf16_rows_declines_what_it_does_not_compute(linear_bf16):
    """None (then F.linear) for: fp32 or mixed dtypes, 16 rows or more, 5 to 15 rows of a product over 2^20
    multiply-adds on a CPU with bf16 instructions (torch's matmul is the faster there; without them it takes
    those), a gradient wanted, an fp32 bias, a shape mismatch (F.linear raises its own error), the kernels off."""
    native = functools.partial(cpu_kernel.linear_bf16, native_bf16=True)  # (sized for a CPU with bf16 instructions)
    x, w = torch.randn(2, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    assert native(x, w) is not None
    assert native(x.float(), w.float()) is None
    assert native(x, w.float()) is None
    assert native(torch.randn(15, 32).bfloat16(), w) is not None
    assert native(torch.randn(16, 32).bfloat16(), w) is None
    big = torch.zeros(1024, 1024).bfloat16()  # (rows x 2^20 multiply-adds)
    assert native(torch.randn(4, 1024).bfloat16(), big) is not None
    assert native(torch.randn(5, 1024).bfloat16(), big) is None
    without = functools.partial(cpu_kernel.linear_bf16, native_bf16=False)  # (no bf16 instructions: up to 47 rows)
    assert without(torch.randn(15, 1024).bfloat16(), big) is not None
    assert without(torch.randn(47, 1024).bfloat16(), big) is not None
    assert without(torch.randn(48, 32).bfloat16(), w) is None
    assert cpu_kernel.linear_bf16(x.requires_grad_(), w) is None
    with torch.no_grad():
        assert cpu_kernel.linear_bf16(x, w) is not None
    x = x.detach()
    assert cpu_kernel.linear_bf16(x, w.requires_grad_()) is None
    w = w.detach()
    assert cpu_kernel.linear_bf16(x, w, torch.randn(8)) is None
    assert cpu_kernel.linear_bf16(torch.randn(2, 31).bfloat16(), w) is None


def test_kernelize_puts_kernel_linears_in_place_of_plain_ones(linear_bf16):
    """`kernelize` replaces each plain nn.Linear without hooks by a KernelLinear holding the same parameters (still
    an nn.Linear to PEFT): fp32 inputs and training are F.linear, bitwise, gradients included; a bf16 decode step
    without autograd is linear_bf16's value (within one bf16 rounding of F.linear). A layer with hooks or a forward
    set on the instance (accelerate's) stays as it is; a PEFT LoRA layer wraps it as its base layer, with the
    adapter taking part; a deep copy or a pickled model calls its own weights; ``kernelize(model, False)`` puts
    plain nn.Linear layers back."""
    import copy
    import pickle

    from transformers_k3.ops.linear import KernelLinear

    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 24, bias=True)
    hooked, instance = torch.nn.Linear(48, 24), torch.nn.Linear(48, 24)
    hooked.register_forward_hook(lambda *args: None)
    instance.forward = lambda inp: torch.nn.functional.linear(inp, instance.weight)
    model = torch.nn.Sequential()
    model.add_module("proj", layer)
    model.add_module("hooked", hooked)
    model.add_module("instance", instance)
    kernelize(model)
    proj = model.proj
    assert type(proj) is KernelLinear and proj.weight is layer.weight and proj.bias is layer.bias
    assert model.hooked is hooked and model.instance is instance
    x = torch.randn(3, 48, requires_grad=True)
    y = proj(x)
    assert torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 24) @ layer.weight)
    model.bfloat16()
    xb = x.detach().bfloat16()
    plain = torch.nn.functional.linear(xb, proj.weight, proj.bias)
    with torch.no_grad():
        out = proj(xb)
        assert torch.equal(out, cpu_kernel.linear_bf16(xb, proj.weight, proj.bias))
        torch.testing.assert_close(out, plain, atol=0, rtol=2**-7)  # (one bf16 rounding apart at most)
        twin = copy.deepcopy(model)
        twin.proj.weight.zero_(), twin.proj.bias.zero_()
        assert not twin.proj(xb).any() and torch.equal(model.proj(xb), out)
        revived = pickle.loads(pickle.dumps(proj))
        assert torch.equal(revived(xb), out)
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["proj"], init_lora_weights=False))
    wrapped = lora.base_model.model.proj
    assert wrapped.base_layer is proj
    with torch.no_grad():
        adapted = wrapped(xb)
        assert torch.equal(wrapped.base_layer(xb), out)
    assert not torch.allclose(adapted.float(), out.float(), atol=1e-2)  # the adapter took part
    kernelize(model, False)
    assert type(wrapped.base_layer) is torch.nn.Linear and wrapped.base_layer.weight is layer.weight


# (x shape, N, UPCAST_BLOCK): a prefill's rows, leading dimensions kept, the fewest rows it takes (48), and blocks
# small enough that both the weight (output features) and the rows are split, with a partial last block of each
UPCAST_SHAPES = [((64, 96), 200, None), ((2, 30, 64), 33, None), ((48, 40), 24, None), ((300, 50), 70, 1000)]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", UPCAST_SHAPES)
def test_linear_bf16_upcast_is_one_rounding_of_an_fp32_sum(shape, with_bias):
    """linear_bf16_upcast (a bf16 prefill's linear on a CPU without bf16 instructions, here forced) is the fp32
    GEMM of the bf16 values rounded once: every output within half a bf16 ulp of an fp32 sum of the exact
    products (the float64 value within K 2^-24 sum |products|), whole or in blocks; unblocked it is bitwise
    F.linear on the fp32 copies, rounded; and torch's bf16 F.linear differs only by near-ties (one bf16 ulp, on at
    most 1 % of the outputs)."""
    x_shape, n, block = shape
    x, w, b = _bf16_linear_operands(x_shape, n, with_bias)
    out = cpu_kernel.linear_bf16_upcast(x, w, b, native_bf16=False, block=block or cpu_kernel.UPCAST_BLOCK)
    _assert_one_rounding_of_an_fp32_sum(out, x, w, b)
    if block is None:
        upcast = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
        assert torch.equal(out, upcast)


def test_linear_bf16_upcast_declines_what_it_does_not_compute():
    """None (then F.linear) for: up to 15 rows, and up to 47 where linear_bf16's kernel runs (it is the faster
    there, in calls of 15 rows), fp32 or mixed dtypes, a gradient wanted, an fp32 bias, a shape mismatch, and
    a CPU with bf16 instructions (torch's bf16 matmul is fast there); `KernelLinear` on a plain bf16 prefill without
    autograd gives its value on this CPU (F.linear's where it declines)."""
    from transformers_k3.ops.linear import KernelLinear

    upcast = functools.partial(cpu_kernel.linear_bf16_upcast, native_bf16=False)  # (a CPU without bf16 instructions)
    w = torch.randn(8, 32).bfloat16()
    assert upcast(torch.randn(48, 32).bfloat16(), w) is not None
    assert upcast(torch.randn(15, 32).bfloat16(), w) is None
    kernel_here = cpu_kernel.library() is not None and cpu_kernel.library().linear_bf16_available()
    assert (upcast(torch.randn(47, 32).bfloat16(), w) is None) == bool(kernel_here)
    x = torch.randn(60, 32).bfloat16()
    assert upcast(x.float(), w.float()) is None
    assert upcast(x, w.float()) is None
    assert upcast(x, w, torch.randn(8)) is None
    assert upcast(torch.randn(40, 31).bfloat16(), w) is None
    assert upcast(x.clone().requires_grad_(), w) is None
    with torch.no_grad():
        assert upcast(x.clone().requires_grad_(), w) is not None
    assert cpu_kernel.linear_bf16_upcast(x, w, native_bf16=True) is None
    layer = KernelLinear(32, 8).bfloat16()
    plain = lambda inp: torch.nn.functional.linear(inp, layer.weight, layer.bias)  # noqa: E731
    with torch.no_grad():
        out = layer(x)
        here = cpu_kernel.linear_bf16_upcast(x, layer.weight, layer.bias)  # (None on a CPU with bf16 instructions)
        assert torch.equal(out, plain(x) if here is None else here)
        torch.testing.assert_close(out, plain(x), atol=0, rtol=2**-7)


@pytest.mark.parametrize("activation", [("situ", 4.0, 25.0), ("situ", 2.5, None), ("silu",)])
@pytest.mark.parametrize("shape", [(2048, 32), (1, 1, 32), (300, 77), (5, 3, 1)])
def test_glu_kernel_values_and_gradients_against_float64(kernel, activation, shape):
    """cpu_kernel.glu (the routed experts' vector GLU on separate gate and up tensors) against situ_glu / silu_glu
    in float64: values within 2e-6 relative and gradients within 2e-6 of the largest, at a decode step's, a prompt's
    and odd widths, with an infinite gate and a large up (the caps); bf16 inputs give the fp32 result rounded."""
    from transformers_k3.modeling_kimi_k3 import situ_glu

    if not kernel.small_gemm_available():
        pytest.skip("no vector GLU in this build (no AVX-512 or AVX2)")
    gen = torch.Generator().manual_seed(shape[-1])
    a, u = torch.randn(shape, generator=gen) * 5, torch.randn(shape, generator=gen) * 40
    a.view(-1)[0] = float("inf")
    if activation[0] == "silu":
        a.view(-1)[0] = 3.0  # (silu(inf) * u is inf, no cap)
        reference = lambda a, u: torch.nn.functional.silu(a) * u  # noqa: E731
    else:
        reference = functools.partial(situ_glu, beta=activation[1], linear_beta=activation[2])
    ad, ud = a.double().requires_grad_(), u.double().requires_grad_()
    want = reference(ad, ud)
    probe = torch.randn(shape, generator=gen, dtype=torch.float64)
    (want * probe).sum().backward()
    ag, ug = a.clone().requires_grad_(), u.clone().requires_grad_()
    got = cpu_kernel.glu(ag, ug, activation)
    assert got.dtype == torch.float32 and got.shape == shape
    assert ((got.double() - want.detach()).abs() <= 2e-6 * want.detach().abs() + 1e-30).all()
    (got * probe.float()).sum().backward()
    for mine, theirs in ((ag.grad, ad.grad), (ug.grad, ud.grad)):
        assert (mine.double() - theirs).abs().max() <= 2e-6 * theirs.abs().max()
    with torch.no_grad():
        fp32 = cpu_kernel.glu(a.bfloat16().float(), u.bfloat16().float(), activation)
        assert torch.equal(cpu_kernel.glu(a.bfloat16(), u.bfloat16(), activation), fp32.bfloat16())
    assert cpu_kernel.glu(a, u.bfloat16(), activation) is None  # mixed dtypes: the caller's torch path


def test_mlp_uses_the_glu_kernel_for_situ_only(kernel):
    """A kernelized KimiK3MLP (the dense MLP and the shared experts) gets the SiTU kernel (cpu_kernel.glu), forward
    and backward matching the module without kernels to fp32 rounding; a SiLU MLP gets none (torch's own ops, bit
    for bit Kimi Linear)."""
    from references import make_config as moe_config
    from transformers_k3.modeling_kimi_k3 import KimiK3MLP

    if not kernel.small_gemm_available():
        pytest.skip("no vector GLU in this build (no AVX-512 or AVX2)")
    for act, expect_kernel in (("situ", True), ("silu", False)):
        torch.manual_seed(0)
        mlp = kernelize(KimiK3MLP(moe_config(hidden_act=act), intermediate_size=24))
        assert (mlp.kernel is not None) == expect_kernel
        x = torch.randn(5, mlp.hidden_size, requires_grad=True)
        out = mlp(x)
        out.square().sum().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
        x.grad = None
        mlp.zero_grad()
        kernelize(mlp, False)
        ref = mlp(x)
        ref.square().sum().backward()
        ref_grads = [x.grad] + [p.grad for p in mlp.parameters()]
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * r.abs().max().item())


@pytest.mark.parametrize("shape", [(70, 128), (3, 5, 7), (1, 16), (300, 33)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_rms_norm_fused_backward_against_float64(kernel, shape, scale):
    """KimiK3RMSNorm in fp32 under autograd (cpu_kernel.rms_norm: torch's two ops forward, k3_rms_norm_backward
    backward): the output bitwise the kernels-off module's, the input and weight gradients within 1e-5 of the largest
    of float64 autograd through the formula (as close as autograd in fp32 comes), at row widths that are no multiple
    of 16 and rows across the kernel's 64-row blocks; 1 and 3 threads bitwise the same; a frozen weight (LoRA) or a
    frozen input get only the other gradient; without autograd, bf16, or without the kernel attached the module's own ops."""
    from transformers_k3.modeling_kimi_k3 import KimiK3RMSNorm

    gen = torch.Generator().manual_seed(shape[-1])
    norm = kernelize(KimiK3RMSNorm(shape[-1], eps=1e-6))
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
    x, probe = torch.randn(shape, generator=gen) * scale, torch.randn(shape, generator=gen)
    xd, wd = x.double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    (xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6) * wd * probe.double()).sum().backward()

    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            xs = x.clone().requires_grad_()
            norm.weight.grad = None
            out = norm(xs)
            assert out.grad_fn is not None and "rms_norm" in type(out.grad_fn).__name__
            (out * probe).sum().backward()
            results.append((out.detach(), xs.grad, norm.weight.grad))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    kernelize(norm, False)
    assert torch.equal(results[0][0], norm(x.clone().requires_grad_()).detach())
    kernelize(norm)
    for mine, want in ((results[0][1], xd.grad), (results[0][2], wd.grad)):
        assert (mine.double() - want).abs().max() <= 1e-5 * want.abs().max()

    norm.weight.requires_grad_(False)
    xs = x.clone().requires_grad_()
    (norm(xs) * probe).sum().backward()
    assert torch.equal(xs.grad, results[0][1])
    norm.weight.requires_grad_(True)
    norm.weight.grad = None
    (norm(x) * probe).sum().backward()
    assert torch.equal(norm.weight.grad, results[0][2])

    assert cpu_kernel.rms_norm(x, norm.weight.detach(), 1e-6) is None  # no autograd: the module's own ops
    assert cpu_kernel.rms_norm(x.bfloat16().requires_grad_(), norm.weight, 1e-6) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_linear_reads_a_parametrized_weight_and_bias(dtype):
    """`KernelLinear` reads plain parameters from the module's dict, and a parametrized weight or bias (not in that
    dict: torch.nn.utils.parametrize moves it) the usual way, so it computes F.linear of the parametrized values."""
    from torch.nn.utils import parametrize

    from transformers_k3.ops.linear import KernelLinear

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    x = torch.randn(3, 16).to(dtype)
    for names in (["weight"], ["bias"], ["weight", "bias"]):
        layer = KernelLinear(16, 8).to(dtype)
        plain_weight, plain_bias = layer.weight.detach().clone(), layer.bias.detach().clone()
        for name in names:
            parametrize.register_parametrization(layer, name, Double())
        want = torch.nn.functional.linear(
            x, plain_weight * (2 if "weight" in names else 1), plain_bias * (2 if "bias" in names else 1)
        )
        with torch.no_grad():
            torch.testing.assert_close(layer(x), want, atol=0, rtol=2**-7)
    no_bias = KernelLinear(16, 8, bias=False).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(no_bias(x), torch.nn.functional.linear(x, no_bias.weight))


def test_kernel_linear_reads_its_weight_again_after_a_change():
    """`KernelLinear` keeps its registered tensors between calls: an in-place update, a replaced parameter, a
    parametrization registered after a call and a plain tensor set in a deleted weight's place each reach the
    next call (F.linear of the values the layer holds then)."""
    from torch.nn.utils import parametrize

    from transformers_k3.ops.linear import KernelLinear

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    x = torch.randn(3, 16)
    layer = KernelLinear(16, 8)

    def check():
        with torch.no_grad():
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))

    check()
    with torch.no_grad():
        layer.weight.mul_(3)
    check()
    layer.weight = torch.nn.Parameter(torch.randn(8, 16))
    check()
    layer.bias = torch.nn.Parameter(torch.randn(8))
    check()
    parametrize.register_parametrization(layer, "weight", Double())
    check()
    parametrize.remove_parametrizations(layer, "weight")
    check()
    plain = torch.randn(8, 16)
    del layer.weight
    layer.weight = plain
    check()
    layer.weight = torch.randn(8, 16)  # (a plain attribute set again: no hook sees it)
    check()


def test_latent_attention_kernel_is_clean_under_sanitizers(tmp_path):
    """csrc/attention_cpu.cpp built alone with AddressSanitizer and UBSan (-march=native, as the extension is) and run
    on 1,000 random shapes against a float64 reference (modeling_tests/data/latent_attention_sanitized.cpp): no
    out-of-bounds read or write, no undefined behaviour, every output within 1e-4."""
    import shutil
    import subprocess

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler here")
    csrc = pathlib.Path(cpu_kernel.__file__).with_name("csrc")
    harness = pathlib.Path(__file__).with_name("data") / "latent_attention_sanitized.cpp"
    binary = tmp_path / "latent_attention_sanitized"
    build = subprocess.run(
        [compiler, "-std=c++17", "-O1", "-g", "-march=native", "-fopenmp", "-fsanitize=address,undefined",
         "-fno-omit-frame-pointer", f"-I{csrc}", str(harness), str(csrc / "attention_cpu.cpp"), "-o", str(binary)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if build.returncode != 0 and "sanitize" in build.stderr:
        pytest.skip(f"this compiler cannot build with the sanitizers: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0", "UBSAN_OPTIONS": "halt_on_error=1"})
    assert run.returncode == 0 and "done, bad 0" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
