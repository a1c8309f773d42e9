"""CUDA check of the KDA op and the K3 model: our PyTorch path against flash-linear-attention's kernels.

Run it through ``bash bench/gpu_check.sh`` (one command, wrapped in ``timeout 290``). Sections:

a. ops: ``transformers_k3.ops.kda.chunk_kda`` / ``fused_recurrent_kda`` (our PyTorch path, "torch") against fla's
   ``chunk_kda`` / ``fused_recurrent_kda`` Triton kernels ("fla", what the KDA layers call on CUDA), on CUDA tensors: fp32 and bf16; T in {1, 63, 64, 65,
   1000, 4097}; H in {4, 32}; D = 128; initial_state + output_final_state; packed batches (cu_seqlens);
   use_qk_l2norm_in_kernel; the K3 layer's gate (precomputed ``-5 sigmoid(.)`` log-decays, fp32 g and beta
   next to bf16 q/k/v) and the in-kernel gate options (lower_bound=-5 with safe_gate, Kimi Linear's softplus
   gate, beta sigmoid); safe_gate=True with the layer's precomputed gates (bounded in (-5, 0), so the layer
   could take fla's faster path); slow and K3-strength decays; state_v_first; grouped values; gradients of
   small cases (with the in-kernel gate's A_log / dt_bias, and a packed batch). Checks run in priority order.
b. model: a tiny K3 config (head_dim 128) on CUDA, logits of prefill, 4 cached decode steps and a packed
   batch with the KDA layers on fla (the automatic choice on CUDA) vs forced onto our PyTorch path, and a
   count proving which runs reached fla's kernels (details in ``section_model``).
d. paths: a left-padded batch's cached decode with each attention implementation (flash_attention_2 when
   flash-attn imports) equal to each row alone; device_map with the embeddings on the CPU and (two GPUs) the
   layers split with the final read on the second; a saved cache loaded without ``device=``; host syncs per
   decode step in our files (torch's sync debug mode); ``torch.compile`` of the decode step (see ``section_paths``).
f. segments: segment training (issue 47) on the device: exact mode's gradients against full-context
   backpropagation, and a truncated step compiled with inductor against eager (see ``section_segments``).
e. parallel: with two or more GPUs, TP and TP+EP over them (torchrun, nccl) against the whole model
   (``section_parallel``; the CPU tests run the same worker over gloo).
c. speed: tokens/s of our PyTorch path vs fla's kernels (also with safe_gate=True), T in {4K, 16K}, H=32,
   D=128, batch 1, bf16, and the single-token decode step (informational; never fails the run).

Each check's line ends with its seconds: on a fresh machine the first call of each kernel configuration
includes Triton's compile and fla's autotuning, which can dominate. Checks not started by their section's
deadline (ops 45% of the budget, model 65%, paths 80%, segments 86%, parallel 92%, speed 100%) are reported NOT RUN; a rerun on the same machine
reuses Triton's on-disk cache, and ``--sections ops`` / ``--sections model,speed`` split the work.

Tolerances (both metrics must hold; ``scale = max(1, max|reference|)``; ``rms = ||diff||_2 / ||ref||_2``)::

    fp32 forward            max|diff| <= 1e-4 * scale   rms <= 1e-4    (TRITON_F32_DEFAULT=ieee, set below)
    fp32 forward, tf32 dots max|diff| <= 3e-2 * scale   rms <= 5e-3    (only if you export TRITON_F32_DEFAULT=tf32)
    bf16 forward            max|diff| <= 6e-2 * scale   rms <= 2e-2
    fp32 gradients          max|diff| <= 1e-3 * scale   rms <= 1e-3
    bf16 gradients          max|diff| <= 0.15 * scale   rms <= 3e-2 (dq, dk, dv, dh0), 6e-2 (dg, dbeta, dA_log, ddt_bias)
    fp32 model logits       max|diff| <= 1e-3 * scale   rms <= 1e-4
    bf16 model logits       measured against the fp32 model: fla's rms <= 2 * ours + 5e-3, max|diff| <= 0.25 * scale

fla's Triton kernels multiply fp32 operands in tf32 unless ``TRITON_F32_DEFAULT=ieee``; this script sets
``ieee`` (unless the variable is already set) so that fp32 is a tight check of the algorithm. In bf16 fla
runs its matmuls in bf16 while our path computes in fp32 from the same bf16 inputs, so the bf16 differences
are fla's rounding (fla's own tests allow an rms ratio of 5e-3 in fp16, which has 3 more mantissa bits).

``--device cpu --dry`` runs every code path except the Triton calls on the CPU: the "fla" side becomes an
adapter with fla's kernel signatures around fla's ``naive_recurrent_kda`` (loaded by file path; fla's package
init needs Triton), and the sizes shrink. ``--dry-fault`` perturbs that adapter's outputs, to show that a
mismatch fails the run.

Exit status: 0 all checks passed (or "SKIP: no CUDA device"); 1 a numeric mismatch or an error; 3 a check
did not run within the time budget.
"""

from __future__ import annotations

import os

# Must be set before Triton compiles anything (fla reads it through Triton at kernel compile time).
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SECTIONS = ("ops", "model", "paths", "segments", "parallel", "speed")


# --------------------------------------------------------------------------------------------------
# Tolerances and the report


@dataclasses.dataclass(frozen=True)
class Tol:
    max_abs: float  # times max(1, max|reference|)
    rms: float  # ||diff|| / ||reference||


def tolerance(kind: str, dtype: torch.dtype, name: str = "") -> Tol:
    bf16 = dtype == torch.bfloat16
    if kind == "fwd":
        if bf16:
            return Tol(6e-2, 2e-2)
        if os.environ.get("TRITON_F32_DEFAULT", "").lower() == "ieee":
            return Tol(1e-4, 1e-4)
        return Tol(3e-2, 5e-3)
    if kind == "grad":
        if not bf16:
            return Tol(1e-3, 1e-3)
        return Tol(0.15, 6e-2 if name in ("g", "beta", "A_log", "dt_bias") else 3e-2)
    if kind == "model":
        return Tol(0.25, math.nan) if bf16 else Tol(1e-3, 1e-4)  # bf16 rms: relative to ours, see section_model
    raise ValueError(kind)


def compare(reference: torch.Tensor, actual: torch.Tensor, tol: Tol) -> tuple[bool, str]:
    if reference.shape != actual.shape:
        return False, f"shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    ref, act = reference.detach().double(), actual.detach().double()
    if not torch.isfinite(act).all():
        return False, "non-finite values"
    if ref.numel() == 0:
        return True, "empty"
    diff = (ref - act).abs()
    max_abs = diff.max().item()
    scale = max(1.0, ref.abs().max().item())
    rms = diff.square().mean().sqrt().item() / (ref.square().mean().sqrt().item() + 1e-30)
    ok = max_abs <= tol.max_abs * scale and (rms <= tol.rms or max_abs <= 1e-6)
    return ok, f"max|d|={max_abs:.2e} (tol {tol.max_abs * scale:.1e}) rms={rms:.2e} (tol {tol.rms:.0e})"


def rms_ratio(actual: torch.Tensor, reference: torch.Tensor) -> float:
    ref, act = reference.detach().double(), actual.detach().double()
    return (ref - act).square().mean().sqrt().item() / (ref.square().mean().sqrt().item() + 1e-30)


class Report:
    """Check results; each printed line ends with the seconds since the last ``start()`` (the first call of a
    kernel configuration includes Triton's compile and autotuning, which dominates a cold run)."""

    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []  # (section, status, line)
        self.mark = time.monotonic()

    def start(self) -> None:
        self.mark = time.monotonic()

    def add(self, section: str, status: str, name: str, detail: str = "") -> None:
        seconds = "" if status in ("NOT RUN", "SKIPPED") else f" [{time.monotonic() - self.mark:.1f} s]"
        line = f"  [{status}] {name}" + (f": {detail}" if detail else "") + seconds
        print(line, flush=True)
        self.rows.append((section, status, line))

    def count(self, status: str, section: str | None = None) -> int:
        return sum(1 for s, st, _ in self.rows if st == status and (section is None or s == section))


# --------------------------------------------------------------------------------------------------
# The "fla" side in --dry mode: fla's kernel signatures around fla's naive recurrent reference


def load_fla_naive():
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("flash-linear-attention (fla) is not installed")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("_gpu_check_fla_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def dry_fla_kernels(fault: float = 0.0):
    """``(chunk_kda, fused_recurrent_kda)`` with fla 0.6.0's keyword arguments, computed by fla's
    ``naive_recurrent_kda`` (exact fp32). The gate formulas are fla's ``fla/ops/kda/gate.py``, the l2norm
    is fla's ``x / sqrt(sum(x^2) + 1e-6)``, written out here independently of ``transformers_k3``."""
    naive = load_fla_naive().naive_recurrent_kda

    def gate(g, A_log, dt_bias, lower_bound):
        heads, key_dim = g.shape[-2:]
        x = g.float() + (0 if dt_bias is None else dt_bias.float().view(heads, key_dim))
        if lower_bound is not None:
            if A_log is not None:
                x = A_log.float().view(heads, 1).exp() * x
            return lower_bound * torch.sigmoid(x)
        return -A_log.float().view(heads, 1).exp() * F.softplus(x)

    def run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
            cu_seqlens, A_log, dt_bias):  # fmt: skip
        if initial_state is not None:
            assert initial_state.dtype == torch.float32, "initial_state must be in float32."  # as fla asserts
        if use_qk_l2norm_in_kernel:
            q = q.float() / torch.sqrt(q.float().square().sum(-1, keepdim=True) + 1e-6)
            k = k.float() / torch.sqrt(k.float().square().sum(-1, keepdim=True) + 1e-6)
        if use_gate_in_kernel:
            g = gate(g, A_log, dt_bias, lower_bound)
        if use_beta_sigmoid_in_kernel:
            beta = beta.float().sigmoid() * (2.0 if allow_neg_eigval else 1.0)
        h0 = initial_state
        if h0 is not None and state_v_first:
            h0 = h0.transpose(-1, -2)
        bounds = [0, q.shape[1]] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
        outs, finals = [], []
        for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
            if cu_seqlens is None:
                part = (q, k, v, g, beta)
                state = h0
            else:
                part = tuple(x[:, start:end] for x in (q, k, v, g, beta))
                state = None if h0 is None else h0[i : i + 1]
            o, s = naive(*part, scale=scale, initial_state=state, output_final_state=True)
            outs.append(o)
            finals.append(s)
        o = torch.cat(outs, 1).to(v.dtype) * (1 + fault)
        final = torch.cat(finals, 0) * (1 + fault) if output_final_state else None
        if final is not None and state_v_first:
            final = final.transpose(-1, -2).contiguous()
        return o, final

    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                  return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                  cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):  # fmt: skip
        A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
        chunk_size = kwargs.pop("chunk_size", 64)
        if chunk_size not in (32, 64):
            raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        if safe_gate and use_gate_in_kernel and (lower_bound is None or not -5 <= lower_bound < 0):
            raise ValueError("`lower_bound` must be in [-5, 0) with safe_gate and use_gate_in_kernel")
        return run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                   cu_seqlens, A_log, dt_bias)  # fmt: skip

    def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                            output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                            state_v_first=False, cu_seqlens=None, **kwargs):  # fmt: skip
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        return run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                   cu_seqlens, A_log, dt_bias)  # fmt: skip

    return chunk_kda, fused_recurrent_kda


class KernelCalls:
    """Counts the calls that reach the "fla" kernels, so a run can prove which path it took."""

    def __init__(self, kernels):
        self.chunk = self.recurrent = 0
        chunk, recurrent = kernels

        def counted_chunk(*args, **kwargs):
            self.chunk += 1
            return chunk(*args, **kwargs)

        def counted_recurrent(*args, **kwargs):
            self.recurrent += 1
            return recurrent(*args, **kwargs)

        self.kernels = (counted_chunk, counted_recurrent)
        self.raw = kernels

    def total(self) -> int:
        return self.chunk + self.recurrent


class KdaSides:
    """The two sides every check compares: ``"torch"``, our KDA operators (``transformers_k3.ops.kda``; options they do
    not take, fla's in-kernel gate and beta sigmoid and the transposed state layout, applied around the call with our
    own gate), and ``"fla"``, fla's kernels (the real ones, or the dry adapter), counted. ``kda_backend`` switches the
    KDA layers of a model between them, where the layers choose their kernels for a device."""

    def __init__(self, calls: KernelCalls):
        import transformers_k3.modeling_kimi_k3 as kda_layer
        from transformers_k3.ops import kda as ours

        self.calls, self._layer, self._ours = calls, kda_layer, ours

    def _ours_call(self, fn, q, k, v, g, beta, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                   allow_neg_eigval=False, lower_bound=None, state_v_first=False, initial_state=None, A_log=None,
                   dt_bias=None, **options):  # fmt: skip
        if use_gate_in_kernel:
            g = self._ours.kda_gate(g, A_log, dt_bias, lower_bound)
        if use_beta_sigmoid_in_kernel:
            beta = beta.float().sigmoid() * (2.0 if allow_neg_eigval else 1.0)
        if initial_state is not None and state_v_first:
            initial_state = initial_state.transpose(-1, -2)
        if fn is self._ours.fused_recurrent_kda:
            options.pop("safe_gate", None)
        o, final = fn(q, k, v, g, beta, initial_state=initial_state, **options)
        if final is not None and state_v_first:
            final = final.transpose(-1, -2).contiguous()
        return o, final

    def chunk_kda(self, *args, backend: str, **kwargs):
        if backend == "fla":
            return self.calls.kernels[0](*args, **kwargs)
        return self._ours_call(self._ours.chunk_kda, *args, **kwargs)

    def fused_recurrent_kda(self, *args, backend: str, **kwargs):
        if backend == "fla":
            return self.calls.kernels[1](*args, **kwargs)
        return self._ours_call(self._ours.fused_recurrent_kda, *args, **kwargs)

    @contextlib.contextmanager
    def kda_backend(self, backend: str):
        def fla_side(counted, kernel):
            names = set(inspect.signature(kernel).parameters) - {"kwargs"}

            def call(*args, **kwargs):  # (as transformers' hub fallback hands fla only the arguments it names)
                return counted(*args, **{key: value for key, value in kwargs.items() if key in names})

            return call

        kernels = ((self._ours.chunk_kda, self._ours.fused_recurrent_kda) if backend == "torch" else
                   tuple(fla_side(*pair) for pair in zip(self.calls.kernels, self.calls.raw)))  # fmt: skip
        original = self._layer._delta_rule_kernels
        self._layer._delta_rule_kernels = lambda device, kernel=None: kernels
        try:
            yield
        finally:
            self._layer._delta_rule_kernels = original


def install_kernels(dry: bool, fault: float) -> KdaSides:
    """fla's kernels, counted: the real ones, or the dry adapter (fla's naive reference, on any device)."""
    if dry:
        calls = KernelCalls(dry_fla_kernels(fault))
    else:
        try:
            from fla.ops.kda import chunk_kda, fused_recurrent_kda
        except Exception as error:  # noqa: BLE001
            raise RuntimeError(f"fla's KDA kernels do not import: {type(error).__name__}: {error}") from error
        calls = KernelCalls((chunk_kda, fused_recurrent_kda))
    return KdaSides(calls)


# --------------------------------------------------------------------------------------------------
# Inputs


def make_inputs(case: dict, device, dtype, seed: int = 0) -> dict:
    """Layer-like inputs: q, k, v raw (normalised in the kernel) in ``dtype``; g the K3 gate's log-decays in
    fp32 (``decay="k3"``: spread over (-5, 0); ``"slow"``: about -0.01, long memory), beta sigmoided fp32;
    or raw g / beta with the in-kernel gate options."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    lengths = case.get("lengths")
    batch, length = (1, sum(lengths)) if lengths else (case["batch"], case["T"])
    heads, dim = case["H"], case["D"]
    v_heads = case.get("HV", heads)
    n_seq = len(lengths) if lengths else batch
    x = {
        "q": rnd(batch, length, heads, dim, dt=dtype),
        "k": rnd(batch, length, heads, dim, dt=dtype),
        "v": rnd(batch, length, v_heads, dim, dt=dtype),
    }
    if not case.get("l2norm", True):
        x["q"], x["k"] = (F.normalize(t.float(), dim=-1).to(dtype) for t in (x["q"], x["k"]))
    raw = rnd(batch, length, v_heads, dim) + (-6.0 if case.get("decay") == "slow" else 0.0)
    A_log = 0.5 * rnd(v_heads)
    dt_bias = 0.5 * rnd(v_heads * dim)
    gate = case.get("gate", "layer")
    options = dict(use_qk_l2norm_in_kernel=case.get("l2norm", True), output_final_state=True)
    if gate == "layer":  # what KimiK3DeltaAttention passes: precomputed fp32 g and beta
        x["g"] = -5.0 * torch.sigmoid(A_log.exp()[:, None] * (raw + dt_bias.view(v_heads, dim)))
        x["beta"] = torch.sigmoid(rnd(batch, length, v_heads))
        if case.get("beta_dtype"):
            x["beta"] = x["beta"].to(dtype)
    else:  # in-kernel gate: raw g, A_log, dt_bias; raw beta through the in-kernel sigmoid
        x["g"] = raw
        x["beta"] = rnd(batch, length, v_heads)
        x["A_log"], x["dt_bias"] = A_log, dt_bias
        options.update(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        if gate == "k3":
            options.update(lower_bound=-5.0)
            if case["fn"] == "chunk":
                options.update(safe_gate=True)
    if case.get("h0", True):
        shape = (n_seq, v_heads, dim, dim)
        x["initial_state"] = rnd(*shape)
    if case.get("state_v_first"):
        options["state_v_first"] = True
    if case.get("safe_gate"):  # precomputed gates bounded in (-5, 0): fla's faster path, same result
        options["safe_gate"] = True
    if lengths:
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        x["cu_seqlens"] = torch.tensor(bounds, dtype=torch.long, device=device)
    return {"tensors": x, "options": options}


def describe(case: dict, dtype) -> str:
    shape = f"lengths={case['lengths']}" if case.get("lengths") else f"B={case['batch']} T={case['T']}"
    extras = [case.get("gate", "layer") + "-gate", case.get("decay", "k3") + "-decay"]
    if "HV" in case:
        extras.append(f"HV={case['HV']}")
    for flag in ("state_v_first", "beta_dtype", "safe_gate"):
        if case.get(flag):
            extras.append(flag)
    if not case.get("l2norm", True):
        extras.append("no-l2norm")
    if not case.get("h0", True):
        extras.append("no-h0")
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    return f"{case['fn']:<9} {name} H={case['H']} D={case['D']} {shape} " + " ".join(extras)


def call(kda_ops, case: dict, inputs: dict, backend: str):
    fn = kda_ops.chunk_kda if case["fn"] == "chunk" else kda_ops.fused_recurrent_kda
    x = dict(inputs["tensors"])
    q, k, v, g, beta = (x.pop(name) for name in ("q", "k", "v", "g", "beta"))
    return fn(q, k, v, g, beta, backend=backend, **x, **inputs["options"])


# --------------------------------------------------------------------------------------------------
# Section a: the op


def op_checks(sizes: dict) -> list[tuple[str, dict]]:
    """``("fwd" | "grad", case)`` in priority order, so that a tight time budget drops the least important."""
    D, (small, large) = sizes["D"], sizes["H"]
    dtypes = (torch.float32, torch.bfloat16)
    checks = []
    # 1. the T sweep, K3 layer inputs, initial state + final state
    for dtype in dtypes:
        for heads in (small, large):
            for length in sizes["T"]:
                checks.append(dict(dtype=dtype, fn="chunk", batch=1 if length > 1000 else 2, T=length, H=heads, D=D))
    # 2. packed batches, and the token loop (decode, verify windows)
    for dtype in dtypes:
        for heads in (small, large):
            checks.append(dict(dtype=dtype, fn="chunk", lengths=sizes["packed"], H=heads, D=D))
            for length in sizes["T_recurrent"]:
                checks.append(dict(dtype=dtype, fn="recurrent", batch=2, T=length, H=heads, D=D))
            checks.append(dict(dtype=dtype, fn="recurrent", lengths=sizes["packed_recurrent"], H=heads, D=D))
    checks = [("fwd", case) for case in checks]
    # 3. gradients of small cases
    T = sizes["T_grad"]
    checks += [("grad", case) for case in (
        dict(dtype=torch.float32, fn="chunk", batch=2, T=T, H=small, D=D),
        dict(dtype=torch.bfloat16, fn="chunk", batch=2, T=T, H=small, D=D),
        dict(dtype=torch.float32, fn="chunk", batch=2, T=T, H=small, D=D, gate="k3", decay="slow"),
        dict(dtype=torch.float32, fn="chunk", lengths=sizes["packed_grad"], H=small, D=D, h0=False),
    )]
    # 4. gate and layout options
    for dtype in dtypes:
        for fn in ("chunk", "recurrent"):
            length = sizes["T_options"] if fn == "chunk" else sizes["T_recurrent"][-1]
            checks += [("fwd", case) for case in (
                dict(dtype=dtype, fn=fn, batch=2, T=length, H=large, D=D, gate="k3"),
                dict(dtype=dtype, fn=fn, batch=2, T=length, H=small, D=D, gate="kimi_linear"),
                dict(dtype=dtype, fn=fn, batch=2, T=length, H=small, D=D, state_v_first=True),
                dict(dtype=dtype, fn=fn, batch=2, T=length, H=small, D=D, l2norm=False, beta_dtype=True),
                dict(dtype=dtype, fn=fn, batch=2, T=length, H=small, D=D, HV=2 * small),
            )]
        checks.append(("fwd", dict(dtype=dtype, fn="chunk", batch=1, T=sizes["T"][-1], H=large, D=D, safe_gate=True)))
    # 5. slow decays (long memory: the state carries across many chunks)
    for dtype in dtypes:
        for heads in (small, large):
            for length in sizes["T_slow"]:
                checks.append(("fwd", dict(dtype=dtype, fn="chunk", batch=1, T=length, H=heads, D=D, decay="slow")))
            checks.append(("fwd", dict(dtype=dtype, fn="chunk", lengths=sizes["packed"], H=heads, D=D, decay="slow",
                                       h0=False)))
    return checks


def check_forward(kda_ops, report: Report, case: dict, device) -> None:
    dtype = case["dtype"]
    inputs = make_inputs(case, device, dtype)
    with torch.no_grad():
        o_ref, s_ref = call(kda_ops, case, inputs, "torch")
        o_fla, s_fla = call(kda_ops, case, inputs, "fla")
    tol = tolerance("fwd", dtype)
    ok_o, detail_o = compare(o_ref, o_fla, tol)
    ok_s, detail_s = compare(s_ref, s_fla, tol)
    report.add("ops", "PASS" if ok_o and ok_s else "FAIL", describe(case, dtype), f"o {detail_o}; state {detail_s}")


def check_gradients(kda_ops, report: Report, case: dict, device) -> None:
    dtype = case["dtype"]
    inputs = make_inputs(case, device, dtype)
    leaves = {name: t for name, t in inputs["tensors"].items() if name != "cu_seqlens"}
    gen = torch.Generator(device=device).manual_seed(1)
    grads = {}
    for backend in ("torch", "fla"):
        tensors = {name: t.detach().clone().requires_grad_(name in leaves) if name in leaves else t
                   for name, t in inputs["tensors"].items()}  # fmt: skip
        o, s = call(kda_ops, case, {"tensors": tensors, "options": inputs["options"]}, backend)
        if backend == "torch":
            gen.manual_seed(1)
            do = torch.randn(o.shape, generator=gen, device=device)
            ds = torch.randn(s.shape, generator=gen, device=device)
        ((o.float() * do).sum() + (s.float() * ds).sum()).backward()
        grads[backend] = {name: tensors[name].grad for name in leaves}
    failures, details = 0, []
    for name in leaves:
        ref, got = grads["torch"][name], grads["fla"][name]
        if ref is None or got is None:
            failures += ref is not got
            details.append(f"d{name} missing ({'torch' if ref is None else 'fla'})")
            continue
        ok, detail = compare(ref, got, tolerance("grad", dtype, name))
        failures += not ok
        details.append(f"d{name} {'ok' if ok else 'MISMATCH'} {detail}")
    report.add("ops", "FAIL" if failures else "PASS", "grad " + describe(case, dtype), "; ".join(details))


def section_ops(kda_ops, report: Report, device, sizes: dict, deadline: float) -> None:
    checks = op_checks(sizes)
    print(f"\n== a. ops: our PyTorch path vs fla, {len(checks)} checks", flush=True)
    for i, (kind, case) in enumerate(checks):
        if time.monotonic() > deadline:
            for kind, rest in checks[i:]:
                report.add("ops", "NOT RUN", ("grad " if kind == "grad" else "") + describe(rest, rest["dtype"]),
                           "time budget")
            return
        report.start()
        try:
            (check_forward if kind == "fwd" else check_gradients)(kda_ops, report, case, device)
        except Exception:  # noqa: BLE001 - any exception is a failed check; keep going
            report.add("ops", "ERROR", describe(case, case["dtype"]), traceback.format_exc().strip().splitlines()[-1])
            traceback.print_exc()


# --------------------------------------------------------------------------------------------------
# Section b: the model


def randomize(model: torch.nn.Module, std: float = 0.08, seed: int = 0) -> None:
    """Random weights large enough that the KDA layers shape the logits (A_log / dt_bias keep their init)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if "norm" in name and param.dim() == 1:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(std * torch.randn(param.shape, generator=gen))


def run_model(model, kda_ops, calls: KernelCalls, backend: str, prompt, steps: list, n_steps: int, packed):
    """Logits of a prefill, ``n_steps`` cached decode steps and a packed batch, with the KDA layers on
    ``backend``; returns them and how many KDA calls reached the "fla" kernels. The decode tokens are taken
    from the first (torch) run and appended to ``steps``, so both runs see the same tokens."""
    before = calls.total()
    with torch.no_grad(), kda_ops.kda_backend(backend):
        out = model(prompt, use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for step in range(n_steps):
            if len(steps) == step:
                steps.append(logits[-1][:, -1:].argmax(-1))
            out = model(steps[step], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
        logits.append(model(packed[0], position_ids=packed[1], use_cache=False).logits)
    return logits, calls.total() - before


def section_model(kda_ops, calls: KernelCalls, report: Report, device, sizes: dict, dry: bool,
                  deadline: float) -> None:
    """Three runs of the tiny K3 config (head_dim of the KDA layers raised to ``model_head_dim``):

    * fp32, the full config (latent MoE layers included): logits must agree to fp32 accuracy;
    * bf16 with dense MLPs in every layer. Two bf16 runs differ by ~1e-2 (rms ratio of the logits) even when
      both KDA sides are exact (seen in --dry mode): one-ulp differences take different bf16 rounding paths
      through the network. So each bf16 run is measured against the fp32 run of the same (bf16-valued)
      weights with our path, and fla's error must stay within ``2 * ours + 5e-3`` (rms ratio) and within the
      bf16 max-abs tolerance. Routed experts are left out here because top-k routing is discontinuous: a
      one-ulp change can flip a token's experts and move its logits by O(1);
    * bf16, the full config: must run and give finite logits; the greedy-token agreement is printed.
    """
    import transformers_k3

    print("\n== b. model: tiny K3, KDA layers on fla vs forced onto our PyTorch path", flush=True)
    lac = {"head_dim": sizes["model_head_dim"]}
    full = transformers_k3.KimiK3TextConfig.tiny(linear_attn_config=lac)
    dense = transformers_k3.KimiK3TextConfig.tiny(linear_attn_config=lac, first_k_dense_replace=full.num_hidden_layers)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, full.vocab_size, (2, sizes["model_T"]), generator=gen).to(device)
    lengths = sizes["model_packed"]
    packed = (torch.randint(3, full.vocab_size, (1, sum(lengths)), generator=gen).to(device),
              torch.cat([torch.arange(n) for n in lengths])[None].to(device))  # fmt: skip
    n_steps = sizes["model_decode_steps"]
    names = ["prefill"] + [f"decode step {i + 1}" for i in range(n_steps)] + ["packed"]
    runs = [("fp32", torch.float32, full, "direct"), ("bf16 dense-MLP", torch.bfloat16, dense, "vs fp32"),
            ("bf16 MoE", torch.bfloat16, full, "smoke")]  # fmt: skip
    for label, dtype, config, mode in runs:
        if time.monotonic() > deadline:
            report.add("model", "SKIPPED" if mode == "smoke" else "NOT RUN", f"model {label}", "time budget")
            continue
        report.start()
        try:
            torch.manual_seed(0)
            model = transformers_k3.KimiK3ForCausalLM(config).eval()
            randomize(model)
            model.to(device=device, dtype=dtype)
            steps = []
            ref, n_torch = run_model(model, kda_ops, calls, "torch", prompt, steps, n_steps, packed)
            got, n_fla = run_model(model, kda_ops, calls, "fla", prompt, steps, n_steps, packed)
            routed = n_torch == 0 and n_fla > 0
            report.add("model", "PASS" if routed else "FAIL", f"model {label}: KDA calls reaching fla kernels",
                       f"torch run {n_torch}, fla run {n_fla}")
            tol = tolerance("model", dtype)
            if mode == "direct":
                for name, a, b in zip(names, ref, got):
                    ok, detail = compare(a.float(), b.float(), tol)
                    report.add("model", "PASS" if ok else "FAIL", f"model {label} {name} logits", detail)
            elif mode == "vs fp32":
                model.float()
                truth, _ = run_model(model, kda_ops, calls, "torch", prompt, steps, n_steps, packed)
                for name, a, b, t in zip(names, ref, got, truth):
                    ours = rms_ratio(a, t)
                    ok, detail = compare(t, b.float(), Tol(tol.max_abs, 2 * ours + 5e-3))
                    report.add("model", "PASS" if ok else "FAIL", f"model {label} {name} logits vs fp32",
                               f"fla {detail}; ours rms={ours:.2e}")
            else:
                finite = all(bool(torch.isfinite(x).all()) for x in ref + got)
                agree = torch.cat([(a.argmax(-1) == b.argmax(-1)).flatten() for a, b in zip(ref, got)])
                report.add("model", "PASS" if finite else "FAIL", f"model {label} runs, finite logits",
                           f"greedy tokens agree at {agree.float().mean().item():.1%} of positions (informational)")
        except Exception:  # noqa: BLE001
            report.add("model", "ERROR", f"model {label}", traceback.format_exc().strip().splitlines()[-1])
            traceback.print_exc()


# --------------------------------------------------------------------------------------------------
# Section d: the model's CUDA paths (attention implementations, devices, cache, host syncs, compile)


def _paths_model(device, sizes: dict, attn: str = "sdpa", dtype=torch.float32):
    import transformers_k3

    config = transformers_k3.KimiK3TextConfig.tiny(linear_attn_config={"head_dim": sizes["model_head_dim"]})
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = transformers_k3.KimiK3ForCausalLM(config).eval()
    randomize(model)
    return model.to(device=device, dtype=dtype), config


def _greedy_logits(model, ids, mask, steps: int):
    """Logits of a cached prefill and ``steps`` greedy decode steps (``[B, steps + 1, V]``, last position each)."""
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    logits, cache = [out.logits[:, -1]], out.past_key_values
    for _ in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1), cache


def _sync_sites(fn) -> list[str]:
    """``file:line`` of each host synchronisation ``fn`` triggers on CUDA (torch's sync debug mode warns on each)."""
    import warnings

    sites = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    for warning in caught:
        if "synchroniz" in str(warning.message):
            sites.append(f"{pathlib.Path(warning.filename).name}:{warning.lineno}")
    return sites


def section_paths(report: Report, device, sizes: dict, dry: bool, deadline: float) -> None:
    """The model on the paths a GPU takes that the CPU tests can only emulate (issue: the CUDA paths):

    * a left-padded batch, prefill + cached decode, with each attention implementation installed (sdpa, eager,
      flash_attention_2 in bf16 when flash-attn imports): each row equals that row run alone, unpadded;
    * ``device_map``: the embeddings on the CPU and the rest on the GPU, and (with two GPUs) the layers split over
      both with the final Attention-Residual read and the head on the second: logits and cached decode equal the
      single-device run;
    * chunks of 24 tokens after a cache (the blockwise path: CUDA's memory-efficient kernel and its log-sum-exp,
      context blocks of 16 tokens) equal one forward over everything;
    * a hybrid cache saved after the prefill and loaded without ``device=``: decoding from it equals decoding on;
    * host syncs in one B=1 decode step and one padded-batch step (torch's sync debug mode; our files must not
      sync in the B=1 step, at most once in the padded one);
    * ``torch.compile`` of the decode step (default mode): equal logits;
    * ``generate()`` on the static cache with its decode steps compiled in ``mode="reduce-overhead"`` (CUDA
      graphs) on a left-padded batch: the eager tokens, one graph, no break, and the time against eager.
    """
    import tempfile

    from transformers_k3 import KimiK3HybridCache

    print("\n== d. paths: attention implementations, device maps, cache load, host syncs, compile", flush=True)
    steps = sizes["model_decode_steps"]
    gen = torch.Generator().manual_seed(1)
    vocab = 512

    def over(name: str) -> bool:
        if time.monotonic() > deadline:
            report.add("paths", "NOT RUN", name, "time budget")
            return True
        report.start()
        return False

    implementations = [("sdpa", torch.float32), ("eager", torch.float32)]
    try:
        from transformers.utils import is_flash_attn_2_available

        if device.type == "cuda" and is_flash_attn_2_available():
            implementations.append(("flash_attention_2", torch.bfloat16))
        else:
            report.add("paths", "SKIPPED", "padded decode, flash_attention_2", "flash-attn not installed (or no CUDA)")
    except ImportError:
        pass
    long_row = torch.randint(3, vocab, (1, sizes["model_T"]), generator=gen).to(device)
    short = sizes["model_T"] // 2
    for attn, dtype in implementations:
        name = f"padded decode, {attn} ({str(dtype).split('.')[-1]})"
        if over(name):
            continue
        try:
            model, config = _paths_model(device, sizes, attn, dtype)
            ids = torch.cat([long_row, torch.cat([torch.zeros(1, sizes["model_T"] - short, dtype=torch.long,
                                                              device=device), long_row[:, :short]], dim=1)])
            mask = torch.ones_like(ids)
            mask[1, : sizes["model_T"] - short] = 0
            with torch.no_grad():
                batched, _ = _greedy_logits(model, ids, mask, steps)
                alone = [_greedy_logits(model, long_row, None, steps)[0],
                         _greedy_logits(model, long_row[:, :short], None, steps)[0]]
            tol = tolerance("model", dtype)
            worst = [compare(alone[row][0].float(), batched[row].float(), tol) for row in range(2)]
            ok = all(flag for flag, _ in worst)
            report.add("paths", "PASS" if ok else "FAIL", name, "; ".join(f"row {r}: {d}" for r, (_, d) in
                                                                          enumerate(worst)))
        except Exception:  # noqa: BLE001
            report.add("paths", "ERROR", name, traceback.format_exc().strip().splitlines()[-1])

    prompt = long_row[:, : sizes["model_T"] // 2]
    layouts = []
    if device.type == "cuda":
        layouts.append(("embeddings on cpu, the rest on cuda:0", lambda n: {
            "model.embed_tokens": "cpu", **{f"model.layers.{i}": 0 for i in range(n)}, "model.norm": 0,
            "model.output_attn_res": 0, "lm_head": 0}))
        if torch.cuda.device_count() >= 2:
            layouts.append(("layers over cuda:0 and cuda:1, final read on cuda:1", lambda n: {
                "model.embed_tokens": 0, **{f"model.layers.{i}": int(i >= n // 2) for i in range(n)},
                "model.norm": 1, "model.output_attn_res": 1, "lm_head": 1}))
        else:
            report.add("paths", "SKIPPED", "device_map over two GPUs", "one CUDA device")
    else:  # the same map with every module on the CPU: checks the module names and accelerate's hooks
        layouts.append(("every module on cpu (dry)", lambda n: {
            "model.embed_tokens": "cpu", **{f"model.layers.{i}": "cpu" for i in range(n)}, "model.norm": "cpu",
            "model.output_attn_res": "cpu", "lm_head": "cpu"}))
    for label, layout in layouts:
        name = f"device_map: {label}"
        if over(name):
            continue
        try:
            from accelerate import dispatch_model

            model, config = _paths_model(device, sizes)
            with torch.no_grad():
                want, _ = _greedy_logits(model, prompt, None, steps)
                placed, _ = _paths_model("cpu", sizes)
                placed = dispatch_model(placed, device_map=layout(config.num_hidden_layers))
                got, _ = _greedy_logits(placed, prompt.to("cpu" if "cpu" in label else device), None, steps)
            ok, detail = compare(want.float(), got.float().to(want.device), tolerance("model", torch.float32))
            report.add("paths", "PASS" if ok else "FAIL", name, detail)
            del placed
        except Exception:  # noqa: BLE001
            report.add("paths", "ERROR", name, traceback.format_exc().strip().splitlines()[-1])

    model, config = _paths_model(device, sizes)
    name = "chunks after the cache (blockwise attention over the context, log-sum-exp merged) equal one forward"
    if not over(name):
        try:
            from transformers_k3.modeling_kimi_k3 import KimiK3MLA

            ids = long_row[:, : 3 * 24]
            layers = [layer for layer in model.modules() if isinstance(layer, KimiK3MLA)]
            block = layers[0].context_block
            for layer in layers:
                layer.context_block = 16  # several context blocks to merge
            try:
                with torch.no_grad():
                    whole = model(ids).logits
                    cache = model(ids[:, :24], use_cache=True).past_key_values
                    parts = [whole[:, :24]] + [model(ids[:, s:s + 24], past_key_values=cache).logits for s in (24, 48)]
            finally:
                for layer in layers:
                    layer.context_block = block
            ok, detail = compare(whole.float(), torch.cat(parts, 1).float(), tolerance("model", torch.float32))
            report.add("paths", "PASS" if ok else "FAIL", name, detail)
        except Exception:  # noqa: BLE001
            report.add("paths", "ERROR", name, traceback.format_exc().strip().splitlines()[-1])

    name = "hybrid cache saved and loaded without device= follows the model"
    if not over(name):
        try:
            with torch.no_grad():
                want, _ = _greedy_logits(model, prompt, None, steps)
                out = model(input_ids=prompt, use_cache=True)
                with tempfile.TemporaryDirectory() as tmp:
                    out.past_key_values.save(pathlib.Path(tmp) / "cache.safetensors")
                    cache = KimiK3HybridCache.load(pathlib.Path(tmp) / "cache.safetensors", config, model=model)
                logits = [out.logits[:, -1]]
                for _ in range(steps):
                    token = logits[-1].argmax(-1, keepdim=True)
                    logits.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1])
            ok, detail = compare(want.float(), torch.stack(logits, 1).float(), tolerance("model", torch.float32))
            report.add("paths", "PASS" if ok else "FAIL", name, detail)
        except Exception:  # noqa: BLE001
            report.add("paths", "ERROR", name, traceback.format_exc().strip().splitlines()[-1])

    for label, batch_ids, batch_mask, limit in (
        ("B=1", prompt, None, 0),
        ("left-padded B=2", torch.cat([prompt, prompt.roll(3, dims=1)]),
         torch.cat([torch.ones_like(prompt), torch.ones_like(prompt).index_fill(1, torch.arange(3, device=device), 0)]),
         1),
    ):
        name = f"host syncs in our code, one decode step, {label}"
        if device.type != "cuda":
            report.add("paths", "SKIPPED", name, "torch's sync debug mode needs CUDA")
            continue
        if over(name):
            continue
        try:
            with torch.no_grad():
                out = model(input_ids=batch_ids, attention_mask=batch_mask, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                mask = None if batch_mask is None else torch.cat([batch_mask, batch_mask.new_ones(2, 1)], 1)
                model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)  # warm-up
                mask = None if mask is None else torch.cat([mask, mask.new_ones(2, 1)], 1)
                sites = _sync_sites(lambda: model(input_ids=token, attention_mask=mask, past_key_values=cache,
                                                  use_cache=True))
            ours = [site for site in sites if not site.startswith(("modeling_utils", "generic", "masking_utils"))]
            report.add("paths", "PASS" if len(ours) <= limit else "FAIL", name,
                       f"{len(sites)} syncs in all ({', '.join(sites[:8]) or 'none'}); at most {limit} allowed in ours")
        except Exception:  # noqa: BLE001
            report.add("paths", "ERROR", name, traceback.format_exc().strip().splitlines()[-1])

    name = "torch.compile of the decode step (default mode)"
    if dry:
        report.add("paths", "SKIPPED", name, "dry run (compiling on the CPU takes minutes)")
    elif not over(name):
        try:
            with torch.no_grad():
                want, _ = _greedy_logits(model, prompt, None, steps)
                compiled = torch.compile(model)
                got, _ = _greedy_logits(compiled, prompt, None, steps)
            ok, detail = compare(want.float(), got.float(), tolerance("model", torch.float32))
            report.add("paths", "PASS" if ok else "FAIL", name, detail)
        except Exception:  # noqa: BLE001
            report.add("paths", "ERROR", name, traceback.format_exc().strip().splitlines()[-1][:200])

    name = "generate() on the static cache, decode steps compiled with mode='reduce-overhead' (CUDA graphs)"
    if dry:
        report.add("paths", "SKIPPED", name, "dry run (compiling on the CPU takes minutes)")
    elif not over(name):
        try:
            from torch._dynamo.utils import counters
            from transformers import CompileConfig

            padded = torch.cat([prompt, prompt.roll(3, dims=1)])
            pad_mask = torch.cat([torch.ones_like(prompt),
                                  torch.ones_like(prompt).index_fill(1, torch.arange(3, device=device), 0)])
            config = CompileConfig(fullgraph=True, mode="reduce-overhead")
            config._compile_all_devices = True
            kwargs = dict(attention_mask=pad_mask, max_new_tokens=steps + 8, min_new_tokens=steps + 8,
                          do_sample=False)
            with torch.no_grad():
                want = model.generate(padded, **kwargs)
                torch._dynamo.reset()
                counters.clear()
                got = model.generate(padded, cache_implementation="static", compile_config=config, **kwargs)
                eager_s = best_time(lambda: model.generate(padded, **kwargs), device, 2)
                graph_s = best_time(lambda: model.generate(padded, cache_implementation="static",
                                                           compile_config=config, **kwargs), device, 2)
            graphs = dict(counters["stats"]).get("unique_graphs", 0)
            breaks = sum(counters["graph_break"].values())
            ok = torch.equal(got, want) and graphs == 1 and breaks == 0
            report.add("paths", "PASS" if ok else "FAIL", name,
                       f"tokens equal: {torch.equal(got, want)}; {graphs} graph(s), {breaks} break(s); "
                       f"{kwargs['max_new_tokens']} tokens: eager {eager_s * 1e3:.1f} ms, compiled {graph_s * 1e3:.1f} ms")
        except Exception:  # noqa: BLE001
            report.add("paths", "ERROR", name, traceback.format_exc().strip().splitlines()[-1][:200])


def section_segments(report: Report, device, sizes: dict, dry: bool, deadline: float) -> None:
    """Segment training on the device (issue 47), where the CPU tests emulate it at most:

    * exact mode, a batch of 2 trajectories in 4 segments (`segment_backward`): the gradients of full-context
      backpropagation (on CUDA the KDA layers' initial-state gradient is fla's ``dh0``; MLA attends its context under
      autograd through `checkpointed_block_attention`, CUDA having no fused kernel backward that takes a merged
      log-sum-exp);
    * truncated mode's step after a no-grad context, compiled (inductor on CUDA, aot_eager in the dry run; MLA's
      context attention is then the ``transformers_k3::mla_context_attention`` operator, CUDA's memory-efficient
      kernel forward and flash attention's backward in plain PyTorch): eager's loss and gradients.
    """
    from transformers_k3 import KimiK3HybridCache
    from transformers_k3.segments import segment_backward

    print("\n== f. segments: exact mode's gradients, a compiled truncated step", flush=True)
    length, segment = sizes["segments_T"], sizes["segments_T"] // 4
    ids = torch.randint(3, 512, (2, length), generator=torch.Generator().manual_seed(3)).to(device)
    tol = tolerance("grad", torch.float32)

    def gradients(model) -> torch.Tensor:
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return torch.cat(grads)

    def check(name: str, reference_and_result) -> bool:
        """Runs one check (``reference_and_result()`` gives the two tensors to compare) unless past the deadline;
        False once it is (the section stops)."""
        if time.monotonic() > deadline:
            report.add("segments", "NOT RUN", name, "time budget")
            return False
        report.start()
        try:
            ok, detail = compare(*reference_and_result(), tol)
            report.add("segments", "PASS" if ok else "FAIL", name, detail)
        except Exception:  # noqa: BLE001
            report.add("segments", "ERROR", name, traceback.format_exc().strip().splitlines()[-1][:200])
        return True

    def exact_mode():
        model, _ = _paths_model(device, sizes)
        model.train()
        model(ids, labels=ids).loss.backward()
        want = gradients(model)
        segment_backward(model, ids, segment_len=segment, mode="exact")
        return want, gradients(model)

    backend = "aot_eager" if dry else "inductor"

    def compiled_truncated_step():
        model, config = _paths_model(device, sizes)
        model.train()

        def step(forward):
            cache = KimiK3HybridCache(config)
            with torch.no_grad():
                model(ids[:, :-segment], past_key_values=cache, use_cache=True)
            loss = forward(input_ids=ids[:, -segment:], past_key_values=cache, labels=ids[:, -segment:]).loss
            loss.backward()
            return torch.cat([loss.detach().view(1), gradients(model)])

        want = step(model)
        torch._dynamo.reset()
        try:
            return want, step(torch.compile(model, backend=backend))
        finally:
            torch._dynamo.reset()

    if check(f"exact mode in 4 segments of {segment} = full-context backpropagation (fp32 gradients)", exact_mode):
        check(f"a truncated-mode step compiled ({backend}) after a {length - segment}-token context = eager's",
              compiled_truncated_step)


def section_parallel(report: Report, device, dry: bool, deadline: float) -> None:
    """Tensor and expert parallelism over the GPUs (nccl, one rank per GPU, up to 4): modeling_tests/_parallel_worker.py
    under torchrun, on a saved tiny checkpoint, against the whole model on each rank (logits, greedy generation,
    a training step's gradients, Quantile Balancing, save + reload, LoRA). Needs two CUDA devices."""
    import json
    import subprocess
    import tempfile

    print("\n== e. parallel: TP and TP+EP over the GPUs (torchrun, nccl)", flush=True)
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if dry or count < 2:
        report.add("parallel", "SKIPPED", "TP / EP over several GPUs",
                   "needs two CUDA devices" + (" (the CPU tests run it over gloo: test_parallel.py)" if dry else ""))
        return
    import transformers_k3

    root = pathlib.Path(__file__).resolve().parents[1]
    processes = 4 if count >= 4 else 2
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = transformers_k3.KimiK3ForCausalLM(transformers_k3.KimiK3TextConfig.tiny())
        randomize(model)
        model.save_pretrained(pathlib.Path(tmp) / "model")
        for mode in ("tp", "ep"):
            name = f"{mode} over {processes} GPUs"
            if time.monotonic() > deadline:
                report.add("parallel", "NOT RUN", name, "time budget")
                continue
            report.start()
            out = pathlib.Path(tmp) / mode
            out.mkdir()
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                                   "--standalone", str(root / "modeling_tests" / "_parallel_worker.py"), mode,
                                   str(pathlib.Path(tmp) / "model"), str(out)],
                                  capture_output=True, text=True, timeout=240)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                report.add("parallel", "ERROR", name, (proc.stderr.strip().splitlines() or ["no output"])[-1][:300])
                continue
            r = json.loads(lines[-1][len("RESULT "):])
            ok = (r["logits_max_diff"] <= 1e-4 * max(1.0, r["logits_scale"]) and r["generate_equal"]
                  and r["grad_rel_norm_diff"] <= 1e-4 and not r["missing_grads"] and r["reloaded_logits_diff"] == 0
                  and r["lora_grad_rel_norm_diff"] <= 1e-4 and r["metrics_equal"])
            report.add("parallel", "PASS" if ok else "FAIL", name,
                       f"logits max|d|={r['logits_max_diff']:.1e}, grads rel={r['grad_rel_norm_diff']:.1e}, "
                       f"generate equal {r['generate_equal']}, a rank holds {r['weight_bytes_ratio']:.0%} of the weights")


# --------------------------------------------------------------------------------------------------
# Section c: speed (informational)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device, repeats: int) -> float:
    fn()  # warm-up: Triton compile / autotune, allocator
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def section_speed(kda_ops, report: Report, device, sizes: dict, dry: bool, deadline: float) -> None:
    heads, dim, dtype = sizes["speed_H"], sizes["D_speed"], torch.bfloat16
    fla_label = "fla (dry: naive reference)" if dry else "fla kernels"
    print(f"\n== c. speed: bf16, batch 1, H={heads}, D={dim}, forward, best of {sizes['speed_repeats']} "
          "(informational)", flush=True)
    variants = [("ours (torch path)", "torch", {}), (fla_label, "fla", {}), ("fla, safe_gate=True", "fla", {"safe_gate": True})]
    print(f"  {'T':>6}" + "".join(f"  {name:>26}" for name, _, _ in variants) + "  (tokens/s)")
    for length in sizes["speed_T"]:
        if time.monotonic() > deadline - sizes["speed_reserve_s"]:
            report.add("speed", "SKIPPED", f"prefill T={length}", "time budget")
            continue
        case = dict(fn="chunk", batch=1, T=length, H=heads, D=dim, h0=False)
        inputs = make_inputs(case, device, dtype)
        rates = []
        for _, backend, extra in variants:
            run = dict(inputs, options={**inputs["options"], **extra})
            with torch.no_grad():
                seconds = best_time(lambda: call(kda_ops, case, run, backend), device, sizes["speed_repeats"])
            rates.append(length / seconds)
        print(f"  {length:>6}" + "".join(f"  {rate:>26,.0f}" for rate in rates)
              + f"  (fla / ours {rates[1] / rates[0]:.1f}x, safe_gate / ours {rates[2] / rates[0]:.1f}x)", flush=True)
        del inputs
    if time.monotonic() > deadline - sizes["speed_reserve_s"] / 2:
        report.add("speed", "SKIPPED", "decode step", "time budget")
        return
    steps = sizes["decode_steps"]
    case = dict(fn="recurrent", batch=1, T=steps, H=heads, D=dim)
    inputs = make_inputs(case, device, dtype)
    x = inputs["tensors"]
    tokens = [{name: x[name][:, t : t + 1] for name in ("q", "k", "v", "g", "beta")} for t in range(steps)]
    times = {}
    for backend in ("torch", "fla"):

        def decode(backend=backend):
            state = x["initial_state"]
            for token in tokens:
                _, state = kda_ops.fused_recurrent_kda(
                    token["q"], token["k"], token["v"], token["g"], token["beta"], initial_state=state,
                    output_final_state=True, use_qk_l2norm_in_kernel=True, backend=backend,
                )  # fmt: skip

        with torch.no_grad():
            times[backend] = best_time(decode, device, sizes["speed_repeats"]) / steps
    print(f"  decode step (fused_recurrent_kda, T=1, fp32 state, {steps} steps): ours {times['torch'] * 1e6:,.1f} us "
          f"({1 / times['torch']:,.0f} tok/s), {fla_label} {times['fla'] * 1e6:,.1f} us ({1 / times['fla']:,.0f} tok/s), "
          f"fla / ours {times['torch'] / times['fla']:.1f}x", flush=True)


# --------------------------------------------------------------------------------------------------


SIZES = {
    "cuda": dict(
        D=128, H=[4, 32], T=[1, 63, 64, 65, 1000, 4097], T_slow=[65, 1000, 4097], T_recurrent=[1, 8, 65],
        packed=[1, 63, 64, 65, 1000, 4097], packed_recurrent=[1, 3, 8, 2], T_options=1000, T_grad=200,
        packed_grad=[37, 63, 100], model_head_dim=128, model_T=200, model_decode_steps=4, model_packed=[70, 60],
        segments_T=512, D_speed=128, speed_H=32, speed_T=[4096, 16384], speed_repeats=3, decode_steps=200,
        speed_reserve_s=20,
    ),
    "dry": dict(
        D=32, H=[2, 4], T=[1, 63, 64, 65, 130], T_slow=[65, 130], T_recurrent=[1, 8, 65],
        packed=[1, 63, 64, 65, 30], packed_recurrent=[1, 3, 8, 2], T_options=70, T_grad=70,
        packed_grad=[17, 33, 20], model_head_dim=32, model_T=70, model_decode_steps=2, model_packed=[40, 30],
        segments_T=96, D_speed=32, speed_H=4, speed_T=[256], speed_repeats=1, decode_steps=8,
        speed_reserve_s=0,
    ),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (only with --dry)")
    parser.add_argument("--dry", action="store_true", help="CPU run with fla's naive reference as the 'fla' side")
    parser.add_argument("--dry-fault", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma list of " + ",".join(SECTIONS))
    parser.add_argument("--budget", type=float, default=270.0, help="seconds; checks not started by then are NOT RUN")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device("cpu" if args.dry else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("SKIP: no CUDA device (torch.cuda.is_available() is False); nothing was checked. "
              "Use --device cpu --dry to exercise the script on the CPU.")
        return 0
    if device.type != "cuda" and not args.dry:
        parser.error("without CUDA the 'fla' side cannot run; add --dry")

    start = time.monotonic()
    report = Report()
    # Checks start only before their section's deadline (time left over rolls on): ops until 45% of the
    # budget, the model until 65%, the paths until 80%, segments until 86%, the parallel runs until 92%, speed until
    # the end.
    deadlines = {"ops": start + 0.45 * args.budget, "model": start + 0.65 * args.budget,
                 "paths": start + 0.8 * args.budget, "segments": start + 0.86 * args.budget,
                 "parallel": start + 0.92 * args.budget, "speed": start + args.budget}
    try:
        import transformers_k3
    except Exception as error:  # noqa: BLE001
        print(f"FAIL: cannot import transformers_k3 ({type(error).__name__}: {error}); run from the repository root, "
              "or pip install -e . (bench/gpu_check.sh sets PYTHONPATH=src)")
        return 1

    torch.set_float32_matmul_precision("highest")  # our fp32 path on CUDA: no tf32 in torch matmuls
    print(f"gpu_check: device {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", torch {torch.__version__}, transformers_k3 from {pathlib.Path(transformers_k3.__file__).parent}")
    versions = []
    for name in ("fla", "triton"):
        try:
            from importlib.metadata import version

            versions.append(f"{name} {version('flash-linear-attention' if name == 'fla' else name)}")
        except Exception:  # noqa: BLE001
            versions.append(f"{name} not installed")
    print(f"  {', '.join(versions)}; TRITON_F32_DEFAULT={os.environ.get('TRITON_F32_DEFAULT')}; "
          f"mode {'DRY (fla side = naive reference on CPU)' if args.dry else 'CUDA kernels'}; budget {args.budget:.0f} s")
    try:
        kda_ops = install_kernels(args.dry, args.dry_fault)
        calls = kda_ops.calls
    except Exception as error:  # noqa: BLE001
        print(f"FAIL: {error}")
        return 1
    sizes = SIZES["dry" if args.dry else "cuda"]
    timings = []
    for section in sections:
        t0 = time.monotonic()
        if section == "ops":
            section_ops(kda_ops, report, device, sizes, deadlines["ops"])
        elif section == "model":
            section_model(kda_ops, calls, report, device, sizes, args.dry, deadlines["model"])
        elif section == "paths":
            section_paths(report, device, sizes, args.dry, deadlines["paths"])
        elif section == "segments":
            section_segments(report, device, sizes, args.dry, deadlines["segments"])
        elif section == "parallel":
            section_parallel(report, device, args.dry, deadlines["parallel"])
        else:
            try:
                section_speed(kda_ops, report, device, sizes, args.dry, deadlines["speed"])
            except Exception:  # noqa: BLE001 - speed is informational, but say what broke
                report.add("speed", "SKIPPED", "speed", traceback.format_exc().strip().splitlines()[-1])
        timings.append(f"{section} {time.monotonic() - t0:.0f} s")

    failed = report.count("FAIL") + report.count("ERROR")
    not_run = report.count("NOT RUN")
    passed = report.count("PASS")
    print(f"\nsections: {', '.join(timings)}; total {time.monotonic() - start:.0f} s")
    for _, status, line in report.rows:
        if status in ("FAIL", "ERROR", "NOT RUN"):
            print(line)
    verdict = "FAIL" if failed else ("INCOMPLETE" if not_run else "PASS")
    print(f"{verdict}: {passed} passed, {failed} failed, {not_run} not run" + (" (DRY run on CPU)" if args.dry else ""))
    return 1 if failed else (3 if not_run else 0)


if __name__ == "__main__":
    sys.exit(main())
