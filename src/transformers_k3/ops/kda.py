"""Kimi Delta Attention (KDA) core: chunked and recurrent forms, with fla's calling conventions.

The recurrence (spec section 4.6), per sequence and head, with state ``S`` of shape ``[K, V]``::

    S <- diag(exp(g_t)) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale * q_t)

On CUDA, when flash-linear-attention (fla) imports, :func:`chunk_kda` and :func:`fused_recurrent_kda`
call fla's Triton kernels. Everywhere else (CPU, or ``backend="torch"``) they run the PyTorch
implementations in this module, which are exact (fp32 state and accumulation whatever the input dtype),
differentiable, and written to be fast on a small CPU:

* the chunked form is the WY/UT-transform algorithm: all per-chunk work (decay-masked ``K K^T`` and
  ``Q K^T``, the unit-lower-triangular solve, ``w``/``u``) is batched over every chunk, head and sequence
  at once, and only the state hand-off between consecutive chunks is a Python loop;
* packed variable-length batches (``cu_seqlens``) pad each sequence only to a multiple of the chunk
  size, and the hand-off loop advances all sequences together.

Decays are handled without overflow: a cumulative log-decay reaches about -160 over a 32-token chunk
at K3's gate bound (-5 per step), so the textbook factorisation ``(q e^{G}) (k e^{-G})^T`` would
evaluate ``e^{160}``. Here the chunk is cut into 16-token sub-chunks: inside one, exponents are taken
relative to its middle token where its decay span allows (checked; a graph takes the caller's bound on the
gate), else each decay is taken whole; between two, the decay is split at sub-chunk boundaries into
factors that are all <= 1. See :func:`_intra_chunk`.

On x86 CPUs subnormal floats (below ~1e-38) are far slower than normal ones, and strong decays produce them in bulk;
values that small are dropped (set to 0) where they arise, which changes results by far less than fp32
rounding, and the one step that creates them by chaining decays (the triangular solve) runs in float64.

On CPU with fp32 compute both entry points run a fused C++ kernel instead
(:mod:`transformers_k3.ops.cpu_kernel`, ``csrc/kda_cpu.cpp``): the chunked algorithm, one task per (sequence,
head) walking its chunks with cache-resident buffers; faster than the PyTorch chunked code here for
prefill, and faster than the token loop from a single token on (decode steps update the state in place). Under
autograd the same kernel computes the forward through the differentiable operator
``transformers_k3::kda_chunk`` (:mod:`transformers_k3.ops.kda_autograd`), whose backward recomputes the
PyTorch chunked path and takes its gradient: CPU training and inference compute the same function. The PyTorch
code stays the path for other compute dtypes and machines without a C++ compiler.

Under torch.compile, packed batches stay in the graph without reading ``cu_seqlens`` on the host: on the PyTorch
path from a zero state, the row becomes one sequence whose decay is reset to 0 at each sequence start; otherwise the
operator ``transformers_k3::kda_chunk`` takes it as a tensor and reads it when it runs (eager's computation, so the
same results; :func:`_traced_packed`).

The backend can be forced per call (``backend=``), for a block of code (:func:`kda_backend`) or for the
process (environment variable ``TRANSFORMERS_K3_KDA_BACKEND``), in that order of precedence.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
import math
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from . import cpu_kernel, kda_autograd
from .conv import assert_cu_seqlens

__all__ = [
    "BACKEND_ENV_VAR",
    "RECURRENT_MAX_TOKENS",
    "TORCH_CHUNK_SIZE",
    "chunk_kda",
    "fused_recurrent_kda",
    "kda",
    "kda_backend",
    "kda_gate",
]

BACKEND_ENV_VAR = "TRANSFORMERS_K3_KDA_BACKEND"
_BACKENDS = ("torch", "fla")
_forced_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("kda_backend", default=None)

# kda() and the KDA layer's cached steps use the token loop up to this many tokens per sequence (on the
# PyTorch path; where the fused CPU kernel applies, both forms run it): the chunked form has a fixed cost per
# call that the loop's per-token cost overtakes between 16 and 32 tokens (bench/RESULTS.md).
RECURRENT_MAX_TOKENS = 16

# Default chunk sizes when chunk_size is None. On CPU, 32 beats 64: the intra-chunk matrices shrink with the
# chunk while the state work per token does not.
TORCH_CHUNK_SIZE = 32
_FLA_CHUNK_SIZE = 64

# fla's safe_gate: precomputed gates in [-5, 0), i.e. |g| <= 5 per token (a 16-token sub-chunk spans <= 80).
_SAFE_GATE_BOUND = 5.0
# Largest sub-chunk; exponents inside a sub-chunk are bounded by its decay span, which must stay below
# _SPAN_LIMIT so that e^{span} (and products of two such factors' masked-out partners) fit in fp32
# (max ~e^88). K3's gate is > -5 per step, so 16 tokens span < 80 and the fast path always applies.
_SUB_CHUNK = 16
_SPAN_LIMIT = 80.0
# Decay factors below e^-40 (4e-18) are set to exactly 0, and so are entries below _FLUSH of the
# intra-chunk matrices that later multiply O(1) values. Both are ~1e-10 of fp32 resolution or less, so
# results do not change, but left alone they turn into subnormal floats, which x86 CPUs process far more
# slowly (enough to slow the whole op at K3's strongest decays). _FLUSH^2 is still a normal float,
# so products of two kept values cannot be subnormal.
_EXP_CUTOFF = -40.0
_EXP_FLOOR = math.exp(_EXP_CUTOFF) * (1 + 1e-5)
_FLUSH = 1e-19
# The chunked path works through the sequence in groups of consecutive steps of about this many
# elements per [rows, C, D] tensor (rows = chunk x head), so that a group's gathered inputs and
# intra-chunk temporaries stay cache-resident (1 MiB each in fp32).
_GROUP_ELEMENTS = 1 << 18
# The sequential loops run on one thread while a step's state is smaller than this many elements
# (e.g. 4 heads of 64 x 64 = 16K). Such steps take microseconds and gain nothing from more threads,
# but every parallel region waits for all its threads, and on an oversubscribed machine a descheduled
# one costs a whole scheduler slice, far more than the step itself. At 32 heads of 128 x 128 (512K elements)
# two threads win.
_SERIAL_STEP_ELEMENTS = 1 << 18


@contextlib.contextmanager
def kda_backend(name: str | None) -> Iterator[None]:
    """Force the KDA backend (``"torch"``, ``"fla"``, or ``None``/``"auto"`` for automatic) inside a
    ``with`` block; an explicit ``backend=`` argument still wins."""
    token = _forced_backend.set(_normalise_backend(name, "kda_backend()"))
    try:
        yield
    finally:
        _forced_backend.reset(token)


def _normalise_backend(name: str | None, source: str) -> str | None:
    if name is None:
        return None
    value = str(name).strip().lower()
    if value in ("", "auto"):
        return None
    if value not in _BACKENDS:
        raise ValueError(f"{source} must be 'torch', 'fla' or None/'auto' (automatic), got {name!r}")
    return value


@functools.cache
def _load_fla() -> tuple[tuple | None, str | None]:
    """Import fla's KDA kernels once; fla imports Triton and may probe the GPU at import time, so any
    failure means "not available" and its message is kept for the error raised on a forced request."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda
    except Exception as error:  # noqa: BLE001 - any import-time failure makes fla unusable here
        return None, f"{type(error).__name__}: {error}"
    return (fla_chunk_kda, fla_fused_recurrent_kda), None


@functools.cache
def _load_fla_inplace_recurrent():
    """fla's recurrent forward that can write the final state into the initial one (``inplace_final_state``, which
    its public ``fused_recurrent_kda`` always turns off), guarded as that entry point guards it; None if absent."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        from fla.utils import input_guard
    except Exception:  # noqa: BLE001 - as in _load_fla
        return None
    if "inplace_final_state" not in inspect.signature(fused_recurrent_kda_fwd).parameters:
        return None
    return input_guard(fused_recurrent_kda_fwd)


def _triton_interpreted() -> bool:
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs fla's kernels on CPU tensors: a forced
    ``backend='fla'`` is then let through, so tests can run fla's own kernels through these wrappers."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _warn_no_fla() -> None:
    import logging

    logging.getLogger(__name__).warning(
        "transformers_k3: KDA on CUDA tensors without flash-linear-attention (%s): the PyTorch path runs instead, "
        "several times slower; install it with `pip install 'transformers-k3[fla]'` (flash-linear-attention==0.6.0)",
        _load_fla()[1])


# Under torch.compile the choice is made once, while tracing (reading the ContextVar would break the graph at
# every KDA call; the backend cannot change inside a compiled graph anyway).
@torch.compiler.assume_constant_result
def _select_backend(backend: str | None, device: torch.device) -> str:
    """Decide on the tensors' device: CPU tensors must never reach Triton, whether or not fla imports."""
    name = _normalise_backend(backend, "backend")
    if name is None:
        name = _forced_backend.get()
    if name is None:
        name = _normalise_backend(os.environ.get(BACKEND_ENV_VAR), f"${BACKEND_ENV_VAR}")
    if name is None:
        if device.type != "cuda":
            return "torch"
        if _load_fla()[0] is None:
            _warn_no_fla()
            return "torch"
        return "fla"
    if name == "fla":
        if device.type != "cuda" and not _triton_interpreted():
            raise ValueError(
                f"backend='fla' runs fla's Triton kernels, which need CUDA tensors, but the inputs are on "
                f"{device}; use backend='torch' (or None to choose automatically)"
            )
        kernels, error = _load_fla()
        if kernels is None:
            raise ValueError(
                f"backend='fla' was requested but flash-linear-attention could not be imported ({error}); "
                "install it (pip install flash-linear-attention) or use backend='torch'"
            )
    return name


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA forget gate (log-decay) from the raw gate projection ``g [..., H, K]`` (spec section 4.4).

    With ``lower_bound`` (K3's "safe gate", ``lower_bound = -5``)::

        g = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, i]))     # in (lower_bound, 0)

    (``exp(A_log)`` is dropped when ``A_log`` is None, as in fla). Without ``lower_bound``::

        g = -exp(A_log[h]) * softplus(g + dt_bias[h, i])                   # softplus threshold 20

    ``A_log`` has ``H`` elements and ``dt_bias`` ``H * K``. fla 0.6.0's in-kernel gate
    (``fla/ops/kda/gate.py``) uses exactly these formulas, so routing ``use_gate_in_kernel`` to fla is
    equivalent. Computed in fp32 (float64 if ``g`` is float64); returns that dtype.
    """
    heads, key_dim = g.shape[-2:]
    dtype = torch.promote_types(g.dtype, torch.float32)
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(heads, key_dim)
    rate = A_log.to(dtype).reshape(heads, 1).exp() if A_log is not None else None
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(x if rate is None else rate * x)
    if rate is None:
        raise ValueError("kda_gate needs A_log when lower_bound is None (the gate is -exp(A_log) * softplus(...))")
    return -rate * F.softplus(x)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int | None = None,
    backend: str | None = None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    safe_gate: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (prefill / training), semantics of fla's ``fla.ops.kda.chunk_kda``.

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``; ``HV`` must be a multiple of ``H`` (grouped values, as in fla).
        g: ``[B, T, HV, K]`` log-space decays (<= 0), already activated unless ``use_gate_in_kernel``.
        beta: ``[B, T, HV]``, already sigmoided unless ``use_beta_sigmoid_in_kernel``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), one row per sequence.
        output_final_state: also return the state after the last token of each sequence.
        use_qk_l2norm_in_kernel: L2-normalise q and k in fp32 as ``x / sqrt(sum(x^2) + 1e-6)``.
        cu_seqlens: ``[N + 1]`` cumulative lengths of sequences packed along T (requires ``B == 1``); the
            state restarts from each sequence's own initial state at its start.
        chunk_size: tokens per chunk; it changes speed, not results. None picks each backend's best:
            64 for fla (which accepts 32 or 64), ``TORCH_CHUNK_SIZE`` (32) for the PyTorch path, where
            it is faster than 64 on CPU. The PyTorch path accepts any positive size.
        backend: ``"torch"``, ``"fla"`` or None (automatic: fla for CUDA tensors when it imports).
        use_gate_in_kernel, A_log, dt_bias, lower_bound: compute ``g`` from the raw gate projection with
            :func:`kda_gate` (``A_log [HV]``, ``dt_bias [HV * K]``).
        safe_gate: fla's fast path for bounded gates; with ``use_gate_in_kernel`` it needs
            ``lower_bound`` in ``[-5, 0)``. It does not change the result.
        use_beta_sigmoid_in_kernel, allow_neg_eigval: ``beta <- sigmoid(beta)`` (times 2 with
            ``allow_neg_eigval``).
        state_v_first: states are laid out ``[..., V, K]`` (SGLang's layout) instead of ``[..., K, V]``.
        cu_seqlens_cpu: host copy of ``cu_seqlens``, saves a device sync.
        **kwargs: further fla-only options, passed to fla; rejected on the PyTorch path.

    Returns:
        ``(o, final_state)``: ``o [B, T, HV, V]`` in ``v``'s dtype (fla's kernel returns ``q``'s dtype);
        ``final_state`` in fp32 (float64 for float64 inputs) or None.
    """
    n_seq = _validate(
        q, k, v, g, beta, initial_state, cu_seqlens, state_v_first,
        use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
        use_beta_sigmoid_in_kernel, allow_neg_eigval,
    )  # fmt: skip
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if _select_backend(backend, q.device) == "fla":
        fla_chunk_kda = _load_fla()[0][0]
        return fla_chunk_kda(
            q, k, v, g, beta,
            scale=scale,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate,
            lower_bound=lower_bound,
            state_v_first=state_v_first,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
            A_log=A_log,
            dt_bias=dt_bias,
            chunk_size=_FLA_CHUNK_SIZE if chunk_size is None else chunk_size,
            **kwargs,
        )  # fmt: skip
    _reject_fla_only(kwargs)
    return _torch_kda(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu, n_seq, state_v_first,
        use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        block=TORCH_CHUNK_SIZE if chunk_size is None else chunk_size,
        gate_bound=_gate_bound(safe_gate, use_gate_in_kernel, lower_bound),
    )  # fmt: skip


def _gate_bound(safe_gate: bool, use_gate_in_kernel: bool, lower_bound: float | None) -> float | None:
    """The largest per-token |g| the call guarantees, or None: an in-kernel gate ``lower_bound * sigmoid(.)`` lies
    in ``(lower_bound, 0)``; fla's ``safe_gate`` promises precomputed gates in ``[-5, 0)``."""
    if use_gate_in_kernel and lower_bound is not None:
        return -float(lower_bound)
    return _SAFE_GATE_BOUND if safe_gate else None


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (decode, short verify windows), semantics of fla's ``fused_recurrent_kda``.

    Same arguments and results as :func:`chunk_kda` without ``chunk_size``/``safe_gate``. The PyTorch
    path is differentiable and, when no gradient is needed, updates one state buffer in place instead of
    allocating a new state per token. fla's kernel has no backward pass, so the fla path refuses inputs
    that require grad (use :func:`chunk_kda` for training).

    ``inplace_final_state=True`` (fla's kernel option of that name; no gradient allowed) writes the final state
    into ``initial_state`` and returns that tensor: a single-token step on an fp32 ``[N, H, K, V]`` state then
    allocates no state at all (other cases compute a new state and copy it back).
    """
    if inplace_final_state:
        if initial_state is None or not output_final_state:
            raise ValueError("inplace_final_state=True needs an initial_state to update and output_final_state=True")
        if _needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
            raise ValueError("inplace_final_state=True cannot be differentiated; run under torch.no_grad()")
    n_seq = _validate(
        q, k, v, g, beta, initial_state, cu_seqlens, state_v_first,
        use_gate_in_kernel, A_log, dt_bias, lower_bound, False,
        use_beta_sigmoid_in_kernel, allow_neg_eigval,
    )  # fmt: skip
    if _select_backend(backend, q.device) == "fla":
        if _needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
            raise ValueError(
                "fla's fused_recurrent_kda has no backward pass but the inputs require grad; use chunk_kda for "
                "training, run under torch.no_grad(), or pass backend='torch'"
            )
        in_place = _load_fla_inplace_recurrent() if inplace_final_state and not kwargs else None
        if in_place is not None and initial_state.dtype == torch.float32 and initial_state.is_contiguous():
            # the kernel reads each state tile and writes it back in place: no new state, no copy back
            o, _ = in_place(
                q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
                output_final_state=True, inplace_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens,
            )  # fmt: skip
            return o, initial_state
        fla_fused_recurrent_kda = _load_fla()[0][1]
        o = fla_fused_recurrent_kda(
            q, k, v, g, beta,
            A_log=A_log,
            dt_bias=dt_bias,
            scale=scale,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval,
            lower_bound=lower_bound,
            state_v_first=state_v_first,
            cu_seqlens=cu_seqlens,
            **kwargs,
        )  # fmt: skip
        if inplace_final_state:  # (a state fla cannot update in place: its result copied back)
            return o[0], initial_state.copy_(o[1])
        return o
    _reject_fla_only(kwargs)
    o, final = _torch_kda(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu, n_seq, state_v_first,
        use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        block=None, inplace=inplace_final_state,
    )  # fmt: skip
    if inplace_final_state and final is not initial_state:
        final = initial_state.copy_(final)
    return o, final


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
    *,
    chunk_size: int | None = None,
    safe_gate: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    recurrent_max_tokens: int = RECURRENT_MAX_TOKENS,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run :func:`fused_recurrent_kda` when every sequence has at most ``recurrent_max_tokens`` tokens
    (decode, speculative verify) and :func:`chunk_kda` otherwise, so callers need not know which form is
    faster for their input. Arguments as for :func:`chunk_kda` (``chunk_size``/``safe_gate`` only reach
    the chunked form). fla's recurrent kernel cannot backpropagate, so on fla inputs that need grad
    always take the chunked form.
    """
    if cu_seqlens is None:
        longest = q.shape[1]
    elif torch.compiler.is_compiling():
        longest = q.shape[1]  # (a traced graph cannot read the sequence lengths; both forms compute the same function)
    else:
        bounds = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
        longest = int(bounds.diff().max()) if bounds.numel() > 1 else 0
    common = dict(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, backend=backend,
        cu_seqlens_cpu=cu_seqlens_cpu, **kwargs,
    )  # fmt: skip
    use_recurrent = longest <= recurrent_max_tokens
    if use_recurrent and q.device.type == "cuda" and _needs_grad(q, k, v, g, beta, initial_state, *kwargs.values()):
        use_recurrent = _select_backend(backend, q.device) == "torch"
    if use_recurrent:
        return fused_recurrent_kda(q, k, v, g, beta, **common)
    return chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, safe_gate=safe_gate, **common)


# --------------------------------------------------------------------------------------------------
# Argument checking


def _needs_grad(*values) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in values)


def _reject_fla_only(kwargs: dict) -> None:
    if kwargs:
        raise ValueError(
            f"{sorted(kwargs)} only apply to fla's CUDA kernels and are not supported by the PyTorch KDA path; "
            "drop them or run on CUDA with fla"
        )


def _validate(
    q, k, v, g, beta, initial_state, cu_seqlens, state_v_first,
    use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
    use_beta_sigmoid_in_kernel, allow_neg_eigval,
) -> int:  # fmt: skip
    """Check shapes, dtypes and option combinations; return the number of sequences N."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}; cast it (e.g. .float())")
        if x.device != q.device:
            raise ValueError(f"all inputs must be on one device: q is on {q.device}, {name} on {x.device}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    batch, length, heads, key_dim = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [B, T, H, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] with q's B and T = {tuple(q.shape[:2])}, got {tuple(v.shape)}")
    v_heads, value_dim = v.shape[2], v.shape[3]
    if v_heads % heads != 0:
        raise ValueError(f"v's head count HV = {v_heads} must be a multiple of q/k's head count H = {heads}")
    if g.shape != (batch, length, v_heads, key_dim):
        raise ValueError(f"g must be [B, T, HV, K] = {(batch, length, v_heads, key_dim)}, got {tuple(g.shape)}")
    if beta.shape != (batch, length, v_heads):
        raise ValueError(
            f"beta must be [B, T, HV] = {(batch, length, v_heads)} (one scalar per head and token), got "
            f"{tuple(beta.shape)}"
        )

    n_seq = batch
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            raise ValueError("cu_seqlens must be a 1-D integer tensor [N + 1] of cumulative sequence lengths")
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens needs at least 2 entries [0, ..., T], got {cu_seqlens.numel()}")
        if batch != 1:
            raise ValueError(
                f"cu_seqlens packs sequences along T and needs batch size 1, got B = {batch}; flatten the "
                "inputs to [1, total_tokens, ...] first"
            )
        n_seq = cu_seqlens.numel() - 1
    if initial_state is not None:
        expected = (n_seq, v_heads, value_dim, key_dim) if state_v_first else (n_seq, v_heads, key_dim, value_dim)
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise ValueError("initial_state must be a floating-point tensor")
        if tuple(initial_state.shape) != expected:
            layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
            raise ValueError(
                f"initial_state must be {layout} = {expected} (N = number of sequences), got "
                f"{tuple(initial_state.shape)}"
            )
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")

    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log [HV] (or lower_bound for the A_log-free safe gate)")
        if A_log is not None and A_log.numel() != v_heads:
            raise ValueError(f"A_log must have HV = {v_heads} elements, got shape {tuple(A_log.shape)}")
        if dt_bias is not None and dt_bias.numel() != v_heads * key_dim:
            raise ValueError(
                f"dt_bias must have HV * K = {v_heads * key_dim} elements, got shape {tuple(dt_bias.shape)}"
            )
        if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
            raise ValueError(
                f"safe_gate=True with use_gate_in_kernel=True needs lower_bound in [-5, 0), got {lower_bound}"
            )
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(
            "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (it scales sigmoid(beta) by 2)"
        )
    return n_seq


def _host_bounds(cu_seqlens: torch.Tensor, length: int) -> list[int]:
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != length or any(b > e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T = {length}, got {bounds}")
    return bounds


# --------------------------------------------------------------------------------------------------
# PyTorch implementation


def _torch_kda(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, n_seq,
    state_v_first, use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
    block, inplace: bool = False, gate_bound: float | None = None,
):  # fmt: skip
    """Shared front and back end of both PyTorch forms; ``block`` is the chunk size, None for the token loop.
    ``inplace``: the final state may be written into ``initial_state`` (the single-token path does so when the
    layouts allow; the caller copies otherwise). ``gate_bound``: see :func:`_gate_bound`."""
    batch, length, heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2], v.shape[3]
    dtype = torch.float32
    for x in (q, k, v, g, beta):
        dtype = torch.promote_types(dtype, x.dtype)
    if scale is None:
        scale = key_dim**-0.5

    out_dtype = v.dtype
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if block is None:
        q = q * scale  # the chunked path scales each group of chunks as it gathers it (one pass less)
    g = kda_gate(g, A_log, dt_bias, lower_bound).to(dtype) if use_gate_in_kernel else g.to(dtype)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    if v_heads != heads:
        q = q.repeat_interleave(v_heads // heads, dim=2)
        k = k.repeat_interleave(v_heads // heads, dim=2)

    if initial_state is None:
        state = q.new_zeros(n_seq, v_heads, key_dim, value_dim)
    else:
        state = initial_state.to(dtype)
        if state_v_first:
            state = state.transpose(-1, -2)

    # The final state may be written into the caller's (the single-token path and the kernel do so).
    write = inplace and state is initial_state and not state_v_first and state.is_contiguous()
    if cu_seqlens is not None and torch.compiler.is_compiling():
        o, final = _traced_packed(q, k, v, g, beta, state, cu_seqlens, scale if block else 1.0,
                                  block or TORCH_CHUNK_SIZE, initial_state is None and not output_final_state)
        o = o.to(out_dtype)
        if not output_final_state:
            return o, None
        return o, final.transpose(-1, -2).contiguous() if state_v_first else final
    bounds = None if cu_seqlens is None else _host_bounds(cu_seqlens, length)
    if cpu_kernel.applies(q, k, v, g, beta, state):
        # The fused kernel computes the chunked form for any length and is faster than the token loop from one
        # token on, so the recurrent entry points use it too (q is already scaled for those).
        fused = cpu_kernel.chunk_forward(q, k, v, g, beta, state, bounds, scale if block else 1.0,
                                         block or TORCH_CHUNK_SIZE, inplace=write)  # fmt: skip
    elif kda_autograd.applies(q, k, v, g, beta, state):
        # Training: the same kernel forward, differentiable, its gradient the PyTorch chunked path's (recomputed in
        # the backward), so CPU training and inference compute one function. Everything above (l2norm, gate, beta
        # sigmoid, grouped values, state layout) stays ordinary autograd.
        fused = kda_autograd.kda_chunk(q, k, v, g, beta, state, cu_seqlens, scale if block else 1.0,
                                       block or TORCH_CHUNK_SIZE)  # fmt: skip
    else:
        fused = None
    if fused is not None:
        o, final = fused
        o = o.to(out_dtype)
        if not output_final_state:
            return o, None
        return o, final.transpose(-1, -2).contiguous() if state_v_first else final

    if block is None and length == 1 and cu_seqlens is None:
        # A decode step: no layout, no token loop, a dozen ops (Python overhead dominated the generic path).
        out, final = _single_token(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, write)
        o = out.unsqueeze(1).to(out_dtype)
        if not output_final_state:
            return o, None
        return o, final.transpose(-1, -2).contiguous() if state_v_first else final

    layout = _Layout(batch, length, bounds, block or 1, q.device)
    state = layout.sort_states(state.contiguous())

    if block is None:
        packed = [layout.pack(x) for x in (q, k, v, g, beta[..., None])]
        out, final = _recurrent(*packed, state, layout)
        o = layout.unpack(out).to(out_dtype)
    else:
        if gate_bound is not None and not use_gate_in_kernel and torch.compiler.is_compiling():
            # (a graph relies on safe_gate's promise about precomputed gates: checked when it runs; NaN passes)
            torch._assert_async(~(g < -gate_bound).any(), "chunk_kda(safe_gate=True) was given gates below -5: "
                                "pass safe_gate=False, or gates in [-5, 0)")
        o, final = _chunked(q, k, v, g, beta[..., None], state, layout, scale, gate_bound)
        o = o.to(out_dtype)
    if not output_final_state:
        return o, None
    final = layout.unsort_states(final)
    if state_v_first:
        final = final.transpose(-1, -2).contiguous()
    return o, final


# Log-decay given to the first token of every packed sequence on the traced PyTorch path (:func:`_traced_packed`):
# e^{-1e4} is exactly 0 in fp32 and float64, so the state entering the token is wiped, a restart from zero.
_RESET_LOG_DECAY = -1e4


def _traced_packed(q, k, v, g, beta, state, cu_seqlens, scale, chunk, zero_start):
    """Packed sequences under torch.compile, where ``cu_seqlens`` cannot be read on the host: ``(o, final)`` as the
    eager code computes them.

    From a zero state and without final states (``zero_start``: the model's packed training) on the PyTorch path,
    the row is one sequence in which the decay at every sequence start is e^{-1e4} = 0: the delta rule then
    restarts from a zero state there, which is exactly what running each sequence separately does (the first
    token's own decay multiplies a zero state, so its gradient is 0 either way), and the graph keeps plain torch
    ops. Otherwise the operator ``transformers_k3::kda_chunk`` (:mod:`kda_autograd`) takes ``cu_seqlens`` as a
    tensor and reads it when it runs: the fused kernel's forward where eager runs it, else the PyTorch path on the
    host bounds, and in both cases the PyTorch path's recomputed gradient.
    """
    kernel = cpu_kernel.applies(q, k, v, g, beta, state) or kda_autograd.applies(q, k, v, g, beta, state)
    if not zero_start or (kernel and cpu_kernel.library() is not None):
        return kda_autograd.kda_chunk(q, k, v, g, beta, state, cu_seqlens, scale, chunk)
    length = q.shape[1]
    edges = assert_cu_seqlens(cu_seqlens.to(device=q.device, dtype=torch.long), length)
    # (a start at T belongs to an empty last sequence; slot T is dropped)
    starts = torch.zeros(length + 1, dtype=torch.bool, device=q.device).index_fill(0, edges, True)[:length]
    g = torch.where(starts[None, :, None, None], torch.tensor(_RESET_LOG_DECAY, dtype=g.dtype, device=g.device), g)
    zero = state.new_zeros(1, *state.shape[1:])
    layout = _Layout(1, length, None, chunk, q.device)
    return _chunked(q, k, v, g, beta[..., None], zero, layout, scale)[0], None


class _Layout:
    """Time-major, block-padded placement of the tokens of all sequences.

    Every sequence is cut into blocks of ``block`` tokens (the chunk size, or 1 for the token loop), its
    last block zero-padded. Sequences are ranked by block count, longest first, and block ``j`` of the
    sequence of rank ``r`` is stored at slot ``offsets[j] + r``. So at step ``j`` the sequences still
    running are exactly the first ``active[j]`` rows of the rank-ordered state batch and their blocks
    are one contiguous slice: the sequential loop needs no gathers, and no sequence is padded beyond a
    multiple of the block size (in particular not to the longest one). Zero padding is inert: a padded
    token has ``k = v = beta = 0`` and ``g = 0``, so it neither writes to nor decays the state.
    """

    def __init__(self, batch: int, length: int, bounds: list[int] | None, block: int, device: torch.device):
        self.batch, self.length, self.block = batch, length, block
        self.order = self.inverse = None
        # For packed sequences: row of each token in a [slots * block] buffer; None for a plain batch,
        # whose layout is a pad + permute.
        self.token_rows = None
        self._index_cache: dict[int, torch.Tensor] = {}
        if bounds is None:
            self.active = [batch] * (-(-length // block))
        else:
            lengths = torch.tensor([end - start for start, end in zip(bounds, bounds[1:])])
            n_seq = lengths.numel()
            blocks = (lengths + block - 1) // block
            order = torch.sort(blocks, descending=True, stable=True).indices
            steps = int(blocks.max())
            ended_by = torch.bincount(blocks, minlength=steps + 1).cumsum(0)  # sequences with <= j blocks
            self.active = (n_seq - ended_by[:steps]).tolist()
            if not torch.equal(order, torch.arange(n_seq)):
                self.order = order.to(device)
                self.inverse = torch.argsort(order).to(device)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(n_seq)
            step_offsets = torch.tensor([0, *self.active]).cumsum(0)
            seq = torch.repeat_interleave(torch.arange(n_seq), lengths)
            pos = torch.arange(length) - torch.tensor(bounds[:-1], dtype=torch.long)[seq]
            slot = step_offsets[pos // block] + rank[seq]
            self.token_rows = (slot * block + pos % block).to(device)
        self.offsets = list(itertools.accumulate([0, *self.active[:-1]])) if self.active else []
        self.n_slots = sum(self.active)

    def _rows(self, heads: int) -> torch.Tensor:
        """Row of every (token, head) pair, token-major like the input, in a flat ``[slots, heads, block]``."""
        if heads not in self._index_cache:
            slot, pos = self.token_rows // self.block, self.token_rows % self.block
            head = torch.arange(heads, device=slot.device)
            self._index_cache[heads] = ((slot[:, None] * heads + head) * self.block + pos[:, None]).reshape(-1)
        return self._index_cache[heads]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H, D]`` -> ``[slots, H, block, D]``, zeros in the padding."""
        heads, dim = x.shape[2], x.shape[3]
        if self.token_rows is None:
            n_blocks = len(self.active)
            if n_blocks * self.block != self.length:
                x = F.pad(x, (0, 0, 0, 0, 0, n_blocks * self.block - self.length))
            x = x.reshape(self.batch, n_blocks, self.block, heads, dim).permute(1, 0, 3, 2, 4)
            return x.reshape(self.n_slots, heads, self.block, dim)
        flat = x.new_zeros(self.n_slots * heads * self.block, dim)
        flat = flat.index_copy(0, self._rows(heads), x.reshape(-1, dim))
        return flat.view(self.n_slots, heads, self.block, dim)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pack`, dropping the padding."""
        heads, dim = y.shape[1], y.shape[3]
        if self.token_rows is None:
            n_blocks = len(self.active)
            y = y.view(n_blocks, self.batch, heads, self.block, dim).permute(1, 0, 3, 2, 4)
            return y.reshape(self.batch, n_blocks * self.block, heads, dim)[:, : self.length].contiguous()
        rows = y.reshape(-1, dim).index_select(0, self._rows(heads))
        return rows.view(1, self.length, heads, dim)

    def chunk_source(self, x: torch.Tensor):
        """``[B, T, H, D]`` -> what :meth:`rows` reads blocks from. Packed sequences are packed whole (one
        gather); a plain batch is not copied at all: a permuted view of its whole blocks, plus the zero-padded
        last block when T is not a multiple of the block size."""
        if self.token_rows is not None:
            return self.pack(x)
        batch, block, heads, dim = self.batch, self.block, x.shape[2], x.shape[3]
        whole = self.length // block
        main = x[:, : whole * block].reshape(batch, whole, block, heads, dim).permute(1, 0, 3, 2, 4)
        if whole * block == self.length:
            return main, None
        tail = F.pad(x[:, whole * block :], (0, 0, 0, 0, 0, (whole + 1) * block - self.length))
        return main, tail.view(batch, 1, block, heads, dim).permute(1, 0, 3, 2, 4)

    def rows(self, source, start: int, stop: int) -> torch.Tensor:
        """Blocks of steps ``start .. stop - 1`` as ``[rows, block, D]``, in scan order (step, rank, head)."""
        if self.token_rows is not None:
            slots = source[self.offsets[start] : self.offsets[stop - 1] + self.active[stop - 1]]
            return slots.reshape(-1, self.block, source.shape[-1])
        main, tail = source
        parts = [main[start : min(stop, main.shape[0])]] if start < main.shape[0] else []
        if stop > main.shape[0]:
            parts.append(tail)
        blocks = parts[0] if len(parts) == 1 else torch.cat(parts)
        return blocks.reshape(-1, self.block, blocks.shape[-1])

    def new_output(self, like: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        """Buffer that :meth:`store` fills and :meth:`finish` turns into ``[B, T, H, dim]``."""
        if self.token_rows is not None:
            return like.new_empty(self.n_slots * heads * self.block, dim)
        return like.new_empty(self.batch, len(self.active) * self.block, heads, dim)

    def store(self, out: torch.Tensor, start: int, stop: int, y: torch.Tensor) -> None:
        """Write the ``[rows, block, dim]`` outputs of steps ``start .. stop - 1`` into ``out``."""
        dim = out.shape[-1]
        if self.token_rows is not None:
            heads = y.shape[0] // (self.offsets[stop - 1] + self.active[stop - 1] - self.offsets[start])
            first = self.offsets[start] * heads * self.block
            out[first : first + y.shape[0] * self.block].copy_(y.reshape(-1, dim))
            return
        heads = out.shape[2]
        steps = out.view(self.batch, len(self.active), self.block, heads, dim).permute(1, 0, 3, 2, 4)
        steps[start:stop].copy_(y.view(stop - start, self.batch, heads, self.block, dim))

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        if self.token_rows is not None:
            heads = out.shape[0] // (self.n_slots * self.block)
            return out.index_select(0, self._rows(heads)).view(1, self.length, heads, out.shape[-1])
        return out[:, : self.length].contiguous()

    def sort_states(self, state: torch.Tensor) -> torch.Tensor:
        return state if self.order is None else state.index_select(0, self.order)

    def unsort_states(self, state: torch.Tensor) -> torch.Tensor:
        return state if self.inverse is None else state.index_select(0, self.inverse)


def _single_token(q, k, v, g, beta, state, write: bool):
    """One token per sequence: ``q`` (scaled), ``k``, ``g`` ``[B, H, K]``, ``v`` ``[B, H, V]``, ``beta`` ``[B, H]``,
    ``state`` ``[B, H, K, V]``. The products of one step of `_recurrent`: ``[(d k)^T S; (d q)^T S]`` in one batched
    product with the old state, ``delta = beta (v - (d k)^T S)``, output ``(d q)^T S + (k . q) delta``, new state
    ``d S + k delta^T``. ``write``: update ``state`` itself (no gradient), else return a new tensor."""
    batch, heads, key_dim = k.shape
    rows = batch * heads
    decay = g.exp()
    s = state.reshape(rows, key_dim, -1)
    both = torch.bmm(torch.stack([k * decay, q * decay], 2).view(rows, 2, key_dim), s)  # [rows, 2, V]
    b = beta.reshape(rows, 1)
    delta = torch.addcmul(v.reshape(rows, -1) * b, b, both[:, 0], value=-1)
    out = torch.addcmul(both[:, 1], (k * q).sum(-1).view(rows, 1), delta)
    d, k_col, delta_row = decay.view(rows, key_dim, 1), k.reshape(rows, key_dim, 1), delta.unsqueeze(1)
    if write:
        s.mul_(d).addcmul_(k_col, delta_row)
        new = state
    elif _needs_grad(q, k, v, g, beta, state):
        new = torch.addcmul(s * d, k_col, delta_row).view_as(state)
    else:
        new = (s * d).addcmul_(k_col, delta_row).view_as(state)
    return out.view(batch, heads, -1), new


def _recurrent(q, k, v, g, beta, state, layout):
    """Token loop over packed ``[slots, H, 1, D]`` inputs (``q`` already scaled) from the rank-ordered
    states ``[N, H, K, V]``; returns ``[slots, H, 1, V]`` outputs and the rank-ordered final states.

    Per step it needs one product with the state: with ``d = e^{g_t}``, the decayed state's reads are
    ``(d k)^T S`` and ``(d q)^T S`` of the *old* state, one ``[2, K] x [K, V]`` product, and the output
    of the updated state follows as ``(d q)^T S + (k . q) delta``. Everything per-token that does not
    touch the state is computed for all tokens before the loop."""
    n_slots, heads, _, key_dim = k.shape
    value_dim = v.shape[-1]
    in_place = not _needs_grad(q, k, v, g, beta, state)
    q, k, g = (x.reshape(-1, key_dim) for x in (q, k, g))
    v = v.reshape(-1, 1, value_dim)
    beta = beta.reshape(-1, 1, 1)
    decay = g.exp()
    reads = torch.stack([k * decay, q * decay], 1)  # [rows, 2, K]
    kq = (k * q).sum(-1).view(-1, 1, 1)
    sizes = [count * heads for count in layout.active]
    steps = zip(
        layout.active,
        *(x.split(sizes) for x in (reads, beta * v, beta, kq, decay.unsqueeze(-1), k.unsqueeze(-1))),
    )
    if in_place:
        state = state.clone()  # never write into the caller's initial_state
        out = v.new_empty(n_slots * heads, 1, value_dim)
        outs = out.split(sizes)
    else:
        outs = []
    full, finished = state, []
    with _serial_if_small(state[:1].numel() * (layout.active[0] if layout.active else 0)):
        for step, (count, read, bv, b, kq_t, d, k_t) in enumerate(steps):
            if count < state.shape[0]:
                if not in_place:
                    finished.append(state[count:])
                state = state[:count]
            s = state.view(count * heads, key_dim, value_dim)
            both = torch.bmm(read, s)  # [(d k)^T S; (d q)^T S]
            delta = torch.addcmul(bv, b, both[:, :1], value=-1)  # beta (v - (d k)^T S)
            if in_place:
                torch.addcmul(both[:, 1:], kq_t, delta, out=outs[step])
                s.mul_(d).addcmul_(k_t, delta)
            else:
                outs.append(torch.addcmul(both[:, 1:], kq_t, delta))
                state = torch.addcmul(s * d, k_t, delta).view(count, heads, key_dim, value_dim)
    if in_place:
        return out.view(n_slots, heads, 1, value_dim), full
    out = torch.cat(outs) if outs else v.new_empty(0, 1, value_dim)
    return out.view(n_slots, heads, 1, value_dim), torch.cat([state, *reversed(finished)])


def _chunked(q, k, v, g, beta, state, layout, scale, gate_bound=None):
    """WY/UT-transform chunked KDA over ``[B, T, H, D]`` inputs (``q`` not yet scaled, ``beta`` ``[B, T, H, 1]``)
    from the rank-ordered states ``[N, H, K, V]``; returns ``[B, T, H, V]`` outputs and the rank-ordered final
    states. ``gate_bound``: a bound on ``|g|`` the caller guarantees (:func:`_gate_bound`), which a traced graph
    uses to decide whether to factor its sub-chunks' decays.

    Per chunk, with ``G_r`` the cumulative log-decay from the chunk start to token ``r`` (inclusive) and
    ``S0`` the state entering the chunk, the corrected values ``n_r = beta_r (v_r - k_r^T S_{r-1}')``
    solve ``(I + A) n = beta v - beta (k e^{G}) S0`` with ``A[r, s] = beta_r k_r . (e^{G_r - G_s} k_s)``
    for ``s < r``; writing ``u = (I + A)^{-1} beta v`` and ``w = (I + A)^{-1} beta k e^{G}`` gives
    ``n = u - w S0``. Then ``o = (q e^{G}) S0 + Aqk n`` with ``Aqk[r, s] = q_r . (e^{G_r - G_s} k_s)``
    for ``s <= r``, and the state leaving the chunk is ``e^{G_C} S0 + (k e^{G_C - G})^T n``.

    Everything but ``n`` and the state hand-off is independent per chunk (:func:`_intra_chunk`). The chunks
    are taken in groups of consecutive steps sized so that a group's inputs and temporaries stay in cache:
    a group's blocks are gathered from the inputs, its intra-chunk work runs batched, then the state is
    carried through its steps and the outputs are written straight into the result. Nothing of the size of
    the whole input is materialised besides the output (this path is memory-bound on CPU otherwise).
    Without gradients the state is updated in place (on a copy of the caller's).
    """
    heads, key_dim, value_dim = state.shape[1:]
    chunk = layout.block
    sources = [layout.chunk_source(x) for x in (q, k, v, g, beta)]
    in_place = not _needs_grad(q, k, v, g, beta, state)
    sub = _SUB_CHUNK
    while chunk % sub:
        sub //= 2
    group = max(1, _GROUP_ELEMENTS // (chunk * max(key_dim, value_dim)))
    # A sub-chunk's decay span is at most sub * max|g|: when that fits, every diagonal block may be factored and no
    # group needs its own check (a host sync per group on a GPU; this is one per call). A traced graph cannot branch
    # on a value: there the caller's bound on |g| decides, and without one the diagonal blocks are taken whole.
    if torch.compiler.is_compiling():
        factored = gate_bound is not None and 0 <= gate_bound * sub <= _SPAN_LIMIT
    else:  # (None: each group checks its own sub-chunks)
        factored = True if g.numel() == 0 or float(g.detach().abs().amax()) * sub <= _SPAN_LIMIT else None

    if in_place:
        state = state.clone()  # never write into the caller's initial_state
        out = layout.new_output(v, heads, value_dim)
    full, finished, outs = state, [], []
    n_steps = len(layout.active)
    serial_size = state[:1].numel() * (layout.active[0] if layout.active else 0)
    start = 0
    while start < n_steps:
        stop, rows = start, 0
        while stop < n_steps and (stop == start or rows + layout.active[stop] * heads <= group):
            rows += layout.active[stop] * heads
            stop += 1
        q_g, k_g, v_g, g_g, b_g = (layout.rows(x, start, stop) for x in sources)
        w, u, qg, kdec, decay, aqk = _intra_chunk(q_g * scale, k_g, v_g, g_g, b_g.squeeze(-1), sub, factored)
        kdec, decay = kdec.transpose(1, 2), decay[:, :, None]
        sizes = [layout.active[step] * heads for step in range(start, stop)]
        parts = (x.split(sizes) for x in (w, u, qg, kdec, decay, aqk))
        group_outs = []
        with _serial_if_small(serial_size):
            for count, w_t, u_t, qg_t, kdec_t, decay_t, aqk_t in zip(layout.active[start:stop], *parts):
                if count < state.shape[0]:
                    if not in_place:
                        finished.append(state[count:])
                    state = state[:count]
                s = state.view(count * heads, key_dim, value_dim)
                n = torch.baddbmm(u_t, w_t, s, alpha=-1)  # corrected values u - w S0
                group_outs.append(torch.baddbmm(torch.bmm(aqk_t, n), qg_t, s))
                if in_place:
                    s.mul_(decay_t).baddbmm_(kdec_t, n)
                else:
                    state = torch.baddbmm(s * decay_t, kdec_t, n).view(count, heads, key_dim, value_dim)
        if in_place:
            layout.store(out, start, stop, torch.cat(group_outs) if len(group_outs) > 1 else group_outs[0])
        else:
            outs.extend(group_outs)
        start = stop
    if in_place:
        return layout.finish(out), full
    final = torch.cat([state, *reversed(finished)]) if finished else state
    if not outs:
        return v.new_zeros(*v.shape[:-1], value_dim), final
    packed = torch.cat(outs).view(layout.n_slots, heads, chunk, value_dim)
    return layout.unpack(packed), final


def _intra_chunk(q, k, v, g, beta, sub, factored: bool | None = None):
    """Everything about a chunk that does not depend on the incoming state, for ``[n, C, D]`` rows.

    Returns ``w, u`` (the WY factors), ``q e^{G}``, ``k e^{G_C - G}``, the chunk decay ``e^{G_C}`` and
    ``Aqk`` (see :func:`_chunked`).

    The pairwise decays ``e^{G_r - G_s}`` (s <= r) are never formed as ``e^{G_r} e^{-G_s}``, which
    overflows. The chunk is split into sub-chunks of ``sub`` tokens:

    * within sub-chunk ``a``, ``e^{G_r - G_s}``: with ``factored``, as ``e^{G_r - G_m} e^{G_m - G_s}``
      around a token ``m`` in its middle, two matrix products; both factors are bounded by ``e^{span}`` of the
      sub-chunk, so this needs the span below ``_SPAN_LIMIT`` (None: checked here). Otherwise each decay is
      the exponential of its own segment's sum, ``<= 1`` whatever the span (``[n, C, sub, K]`` temporaries,
      elementwise);
    * for ``s`` in an earlier sub-chunk ``b``, the decay splits at the sub-chunk boundaries into
      ``e^{G_r - G_start(a)} e^{G_start(a) - G_end(b)} e^{G_end(b) - G_s}``: three factors <= 1, each
      >= the product, so one that is negligible makes the product negligible.

    Log-decays are summed only over the segment they span (local prefix sums inside a sub-chunk plus
    whole sub-chunk totals), never as the difference of two long prefix sums, so short gaps late in a
    strongly decaying chunk keep full fp32 accuracy.
    """
    n, chunk, key_dim = k.shape
    local = g.view(n, chunk // sub, sub, key_dim).cumsum(2)  # G_r - G_start(a), inclusive of r
    if factored is None:
        low, high = torch.aminmax(local.detach(), dim=2)
        factored = not n or float((high.clamp(min=0) - low.clamp(max=0)).max()) <= _SPAN_LIMIT
    return _intra_body(q, k, v, beta, g, local, factored)


def _intra_body(q, k, v, beta, g, local, factored: bool = True):
    """:func:`_intra_chunk` once the sub-chunk size is fixed: ``local`` ``[n, n_sub, sub, K]`` holds the
    log-decays ``g`` summed from each sub-chunk's start."""
    n, n_sub, sub, key_dim = local.shape
    chunk = n_sub * sub
    total = local[:, :, -1]  # [n, n_sub, K]
    g_sub = g.view(n, n_sub, sub, key_dim)
    # G_end(b) - G_s, summed over its own tokens (not total - local: a packed row's reset decay would cancel)
    tail = torch.cat([g_sub[:, :, 1:].flip(2).cumsum(2).flip(2), total.new_zeros(n, n_sub, 1, key_dim)], 2)
    zero = total.new_zeros(n, 1, key_dim)
    before = torch.cat([zero, total[:, :-1].cumsum(1)], 1)  # sub-chunks before a
    after = torch.cat([total[:, 1:].flip(1).cumsum(1).flip(1), zero], 1)  # sub-chunks after b
    prefix = (local + before[:, :, None]).view(n, chunk, key_dim)  # G_r
    suffix = (tail + after[:, :, None]).view(n, chunk, key_dim)  # G_C - G_s

    k_sub = k.view(n, n_sub, sub, key_dim)
    q_sub = q.view(n, n_sub, sub, key_dim)
    # scores[:, 0] = k_r . (e^{G_r - G_s} k_s) and scores[:, 1] = q_r . (...), both [n, C, C] in blocks.
    scores = k.new_zeros(n, 2, n_sub, sub, chunk)
    if factored:
        up = (local - local[:, :, (sub - 1) // 2, None]).exp()  # e^{G_r - G_m}
        rows = torch.stack([k_sub * up, q_sub * up], 2).reshape(n * n_sub, 2 * sub, key_dim)  # k then q rows of a
        cols = (k_sub * up.reciprocal()).reshape(n * n_sub, sub, key_dim)
        diagonal = torch.bmm(rows, cols.transpose(1, 2)).view(n, n_sub, 2, sub, sub)
    else:
        pos = torch.arange(sub, device=local.device)
        later = (pos[:, None] > pos[None, :])[:, :, None]  # t > s
        # G_r - G_s = g_{s+1} + ... + g_r: a sum over r of the gates masked to t > s, [n, a, r, s, K]
        segment = torch.where(later, g_sub[:, :, :, None], 0).cumsum(2)
        within = torch.where((pos[:, None] >= pos[None, :])[:, :, None], _exp_cut(segment), 0)  # s <= r
        decayed = within * k_sub[:, :, None]  # e^{G_r - G_s} k_s
        diagonal = torch.stack([(decayed * k_sub[:, :, :, None]).sum(-1), (decayed * q_sub[:, :, :, None]).sum(-1)],
                               2)  # fmt: skip
    blocks = scores.view(n, 2, n_sub, sub, n_sub, sub).diagonal(dim1=2, dim2=4)  # [n, 2, sub, sub, a]
    blocks.copy_(diagonal.permute(0, 2, 3, 4, 1))
    if n_sub > 1:
        into = _exp_cut(local[:, 1:])  # e^{G_r - G_start(a)}, row blocks a >= 1
        rows = torch.cat([k_sub[:, 1:] * into, q_sub[:, 1:] * into], 2)  # [n, a - 1, 2 sub, K]
        cols = k_sub[:, :-1] * _exp_cut(tail[:, :-1])  # e^{G_end(b) - G_s} k_s, column blocks b < last
        for a in range(1, n_sub):
            linked = cols[:, :a]
            if a > 1:
                # e^{G_start(a) - G_end(b)}: sub-chunks b + 1 .. a - 1 summed from a - 1 down; 1 for b = a - 1
                between = total[:, 1:a].flip(1).cumsum(1).flip(1)
                link = torch.cat([_exp_cut(between), between.new_ones(n, 1, key_dim)], 1)
                linked = linked * link[:, :, None]
            part = torch.bmm(rows[:, a - 1], linked.reshape(n, a * sub, key_dim).transpose(1, 2))
            scores[:, :, a, :, : a * sub] = part.view(n, 2, sub, a * sub)
    scores = scores.view(n, 2, chunk, chunk)
    # Entries below _FLUSH only ever scale O(1) values; zeroing them keeps subnormal floats (slow on x86)
    # out of the products that follow.
    aqk = F.hardshrink(scores[:, 1], _FLUSH).tril()

    # (I + A)^{-1}, with A = beta_r k_r . (e^{G_r - G_s} k_s) strictly below the diagonal (the solve
    # reads nothing else), is solved in float64: forward substitution chains decays, so some entries
    # are legitimately ~1e-40, subnormal in fp32, where the solve runs far slower.
    beta = beta[:, :, None]
    eye = torch.eye(chunk, dtype=torch.float64, device=k.device).expand(n, chunk, chunk)
    inverse = torch.linalg.solve_triangular(scores[:, 0] * beta.double(), eye, upper=False, unitriangular=True)
    inverse = F.hardshrink(inverse, _FLUSH).to(k.dtype)

    growth = _exp_cut(prefix)  # e^{G_r} <= 1
    u = F.hardshrink(torch.bmm(inverse, v * beta), _FLUSH)
    w = F.hardshrink(torch.bmm(inverse, k * (growth * beta)), _FLUSH)
    return w, u, q * growth, k * _exp_cut(suffix), growth[:, -1], aqk


@contextlib.contextmanager
def _serial_if_small(step_elements: int) -> Iterator[None]:
    """Run a sequential loop on one intra-op thread when its steps are small (see _SERIAL_STEP_ELEMENTS).
    Not under torch.compile: the thread switch is a Python side effect that would break the graph."""
    if torch.compiler.is_compiling():
        yield
        return
    threads = torch.get_num_threads()
    if threads == 1 or step_elements >= _SERIAL_STEP_ELEMENTS:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _exp_cut(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)``, but exactly 0 at or below ``e^_EXP_CUTOFF``, so no subnormal floats enter later
    products. Clamping first keeps ``exp`` on its fast path: vectorised exp slows down sharply on
    inputs whose result underflows (or is -inf)."""
    return F.threshold(x.clamp(min=_EXP_CUTOFF).exp(), _EXP_FLOOR, 0.0)
