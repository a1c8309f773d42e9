"""Kimi Delta Attention (KDA): :func:`chunk_kda` and :func:`fused_recurrent_kda`, with fla's calling conventions for
the options the model passes. They run on any device: the fused CPU kernel (fp32 CPU tensors,
:mod:`transformers_k3.ops.cpu_kernel`), under autograd through ``transformers_k3::kda_chunk`` (:mod:`.autograd`), and
the PyTorch algorithms (:mod:`.chunk`, :mod:`.fused_recurrent`) everywhere else. fla's Triton kernels come in on the
model side (``use_kernel_func_from_hub_with_fallback`` in ``modeling_kimi_k3.py``), for CUDA tensors.

The recurrence (spec section 4.6), per sequence and head, with state ``S`` of shape ``[K, V]``::

    S <- diag(exp(g_t)) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale * q_t)

Both forms keep the state and accumulate in fp32 (float64 for float64 inputs), whatever the input dtype.
"""

from __future__ import annotations

import functools

import torch

from .. import cpu_kernel
from ..conv import assert_cu_seqlens
from ..torch_internals import any_autocast_enabled
from . import autograd
from .chunk import TORCH_CHUNK_SIZE, chunked
from .fused_recurrent import recurrent, single_token
from .layout import Layout, host_bounds, needs_grad

__all__ = ["RECURRENT_MAX_TOKENS", "TORCH_CHUNK_SIZE", "chunk_kda", "fused_recurrent_kda"]

# Tokens per sequence up to which the KDA layer's cached steps take the recurrent form: the chunked form's fixed
# cost per call overtakes the token loop's per-token cost above it (bench/RESULTS.md).
RECURRENT_MAX_TOKENS = 16

# fla's safe_gate promise: precomputed gates in [-5, 0), i.e. |g| <= 5 per token.
_SAFE_GATE_BOUND = 5.0


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
    *,
    safe_gate: bool = False,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (prefill / training), semantics of fla's ``fla.ops.kda.chunk_kda``.

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``; ``HV`` must be a multiple of ``H`` (grouped values, as in fla).
        g: ``[B, T, HV, K]`` log-space decays (<= 0), already activated (:func:`.gate.kda_gate`).
        beta: ``[B, T, HV]``, already sigmoided.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``, one row per sequence.
        output_final_state: also return the state after the last token of each sequence.
        use_qk_l2norm_in_kernel: L2-normalise q and k in fp32 as ``x / sqrt(sum(x^2) + 1e-6)``.
        cu_seqlens: ``[N + 1]`` cumulative lengths of sequences packed along T (requires ``B == 1``); the
            state restarts from each sequence's own initial state at its start.
        chunk_size: tokens per chunk; it changes speed, not results. None: ``TORCH_CHUNK_SIZE``.
        safe_gate: the caller promises gates in ``[-5, 0)`` (K3's gate); a traced graph uses the bound to factor its
            sub-chunks' decays. It does not change the result.
        kernel: compute with the fused CPU kernel where the tensors allow (fp32 on CPU; under autograd its forward
            with the PyTorch path's gradient); the KDA layer's kernel (`kernelize`) passes True. False: PyTorch.

    Returns:
        ``(o, final_state)``: ``o [B, T, HV, V]`` in ``v``'s dtype; ``final_state`` in fp32 (float64 for float64
        inputs) or None.
    """
    n_seq = _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    return _torch_kda(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, n_seq,
        block=TORCH_CHUNK_SIZE if chunk_size is None else chunk_size,
        gate_bound=_SAFE_GATE_BOUND if safe_gate else None, kernel=kernel,
    )  # fmt: skip


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
    *,
    inplace_final_state: bool = False,
    output_state_history: bool = False,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Token-by-token KDA (decode, short verify windows), semantics of fla's ``fused_recurrent_kda``.

    Same arguments and results as :func:`chunk_kda` (``kernel`` included) without ``chunk_size``/``safe_gate``. Differentiable; without
    gradients it updates one state buffer in place instead of allocating a new state per token.

    ``inplace_final_state=True`` (fla's kernel option of that name; no gradient allowed) writes the final state
    into ``initial_state`` and returns that tensor.

    ``output_state_history=True`` (no ``cu_seqlens``) returns ``(o, final_state, history)``: ``history`` holds the
    state before the first token (``initial_state`` itself, or zeros) and after each token, ``T + 1`` tensors
    ``[B, HV, K, V]``, none of them aliasing another (what a cache keeps to roll back to any of those tokens).
    """
    if inplace_final_state:
        if initial_state is None or not output_final_state:
            raise ValueError("inplace_final_state=True needs an initial_state to update and output_final_state=True")
        if needs_grad(q, k, v, g, beta, initial_state):
            raise ValueError("inplace_final_state=True cannot be differentiated; run under torch.no_grad()")
        if output_state_history:
            raise ValueError("output_state_history=True keeps every state: it cannot update initial_state in place")
    n_seq = _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    if output_state_history:
        if cu_seqlens is not None:
            raise ValueError("output_state_history=True takes a plain batch [B, T, ...]; pass cu_seqlens=None")
        return _with_history(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, kernel)
    o, final = _torch_kda(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, n_seq,
        block=None, inplace=inplace_final_state, kernel=kernel,
    )  # fmt: skip
    if inplace_final_state and final is not initial_state:
        final = initial_state.copy_(final)
    return o, final


def _with_history(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, kernel):
    """One token at a time, each the recurrent form's own step, keeping the state after each."""
    batch, length, _, key_dim = q.shape
    v_heads, value_dim = v.shape[2:]
    state = initial_state
    if state is None:
        dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
        state = q.new_zeros(batch, v_heads, key_dim, value_dim, dtype=dtype)
    history, outputs = [state], []
    for t in range(length):
        step = [x[:, t : t + 1] for x in (q, k, v, g, beta)]
        out, state = _torch_kda(*step, scale, state, True, use_qk_l2norm_in_kernel, None, batch, block=None,
                                kernel=kernel)
        outputs.append(out)
        history.append(state)
    o = torch.cat(outputs, dim=1) if outputs else v.new_zeros(*v.shape)
    return o, state, history


def attach_kda(layer) -> tuple:
    """The KDA layer's kernel (`kernelize`): ``(chunked, recurrent)``, :func:`chunk_kda` and
    :func:`fused_recurrent_kda` computed by the fused CPU kernel where the tensors allow."""
    return functools.partial(chunk_kda, kernel=True), functools.partial(fused_recurrent_kda, kernel=True)


# --------------------------------------------------------------------------------------------------
# Argument checking


def _validate(q, k, v, g, beta, initial_state, cu_seqlens) -> int:
    """Check shapes and dtypes; return the number of sequences N."""
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
        expected = (n_seq, v_heads, key_dim, value_dim)
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise ValueError("initial_state must be a floating-point tensor")
        if tuple(initial_state.shape) != expected:
            raise ValueError(
                f"initial_state must be [N, HV, K, V] = {expected} (N = number of sequences), got "
                f"{tuple(initial_state.shape)}"
            )
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    return n_seq


# --------------------------------------------------------------------------------------------------
# Dispatch between the CPU operator and the PyTorch algorithms


# (a device type's autocast support does not change in a process: asked once, not on every decode step)
_autocast_available = functools.lru_cache(maxsize=None)(torch.amp.is_autocast_available)


def _autocast_enabled(x: torch.Tensor) -> bool:
    """Whether autocast is on for ``x``'s device type (False for a type without autocast, such as meta, where asking
    raises). On CPU, every decode step, first one call that parses no device-type string (`any_autocast_enabled`,
    which asks about CPU too): `torch.is_autocast_enabled` and ``x.device`` cost more than the rest of the guard."""
    if x.is_cpu:
        return any_autocast_enabled() and torch.is_autocast_enabled("cpu")
    device_type = x.device.type
    return _autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _torch_kda(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, n_seq,
    block, inplace: bool = False, gate_bound: float | None = None, kernel: bool = False,
):  # fmt: skip
    """Shared front and back end of both PyTorch forms; ``block`` is the chunk size, None for the token loop.
    ``inplace``: the final state may be written into ``initial_state`` (the single-token path does so when the
    layouts allow; the caller copies otherwise). ``gate_bound``: a bound on ``|g|`` the caller guarantees.
    ``kernel``: the fused CPU kernel computes the call where the tensors allow."""
    if _autocast_enabled(q):
        # (the op's precision is its own, fp32 math and state as fla's kernels: autocast would run its products in bf16
        # and refuse the state's in-place update)
        with torch.autocast(q.device.type, enabled=False):
            return _torch_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                              cu_seqlens, n_seq, block, inplace, gate_bound, kernel)  # fmt: skip
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
    g = g.to(dtype)
    if v_heads != heads:
        q = q.repeat_interleave(v_heads // heads, dim=2)
        k = k.repeat_interleave(v_heads // heads, dim=2)

    if initial_state is None:
        state = q.new_zeros(n_seq, v_heads, key_dim, value_dim)
    else:
        state = initial_state.to(dtype)

    # The final state may be written into the caller's (the single-token path and the kernel do so).
    write = inplace and state is initial_state and state.is_contiguous()
    if cu_seqlens is not None and torch.compiler.is_compiling():
        o, final = _traced_packed(q, k, v, g, beta, state, cu_seqlens, scale if block else 1.0,
                                  block or TORCH_CHUNK_SIZE, initial_state is None and not output_final_state, kernel)
        o = o.to(out_dtype)
        if not output_final_state:
            return o, None
        return o, final
    bounds = None if cu_seqlens is None else host_bounds(cu_seqlens, length)
    if kernel and cpu_kernel.applies(q, k, v, g, beta, state):
        # The fused kernel computes the chunked form for any length and is faster than the token loop from one
        # token on, so the recurrent entry points use it too (q is already scaled for those).
        fused = cpu_kernel.chunk_forward(q, k, v, g, beta, state, bounds, scale if block else 1.0,
                                         block or TORCH_CHUNK_SIZE, inplace=write)  # fmt: skip
    elif kernel and autograd.applies(q, k, v, g, beta, state):
        # Training: the same kernel forward, differentiable, its gradient the PyTorch chunked path's (recomputed in
        # the backward), so CPU training and inference compute one function. Everything above (l2norm, gate, beta
        # sigmoid, grouped values, state layout) stays ordinary autograd.
        fused = autograd.kda_chunk(q, k, v, g, beta, state, cu_seqlens, scale if block else 1.0,
                                       block or TORCH_CHUNK_SIZE)  # fmt: skip
    else:
        fused = None
    if fused is not None:
        o, final = fused
        o = o.to(out_dtype)
        if not output_final_state:
            return o, None
        return o, final

    if block is None and length == 1 and cu_seqlens is None:
        # A decode step: no layout, no token loop, a dozen ops (Python overhead dominated the generic path).
        out, final = single_token(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, write)
        o = out.unsqueeze(1).to(out_dtype)
        if not output_final_state:
            return o, None
        return o, final

    layout = Layout(batch, length, bounds, block or 1, q.device)
    state = layout.sort_states(state.contiguous())

    if block is None:
        packed = [layout.pack(x) for x in (q, k, v, g, beta[..., None])]
        out, final = recurrent(*packed, state, layout)
        o = layout.unpack(out).to(out_dtype)
    else:
        if gate_bound is not None and torch.compiler.is_compiling():
            # (a graph relies on safe_gate's promise about precomputed gates: checked when it runs; NaN passes)
            torch._assert_async(~(g < -gate_bound).any(), "chunk_kda(safe_gate=True) was given gates below -5: "
                                "pass safe_gate=False, or gates in [-5, 0)")
        o, final = chunked(q, k, v, g, beta[..., None], state, layout, scale, gate_bound)
        o = o.to(out_dtype)
    if not output_final_state:
        return o, None
    return o, layout.unsort_states(final)


# Log-decay given to the first token of every packed sequence on the traced PyTorch path (:func:`_traced_packed`):
# e^{-1e4} is exactly 0 in fp32 and float64, so the state entering the token is wiped, a restart from zero.
_RESET_LOG_DECAY = -1e4


def _traced_packed(q, k, v, g, beta, state, cu_seqlens, scale, chunk, zero_start, kernel):
    """Packed sequences under torch.compile, where ``cu_seqlens`` cannot be read on the host: ``(o, final)`` as the
    eager code computes them.

    From a zero state and without final states (``zero_start``: the model's packed training) on the PyTorch path,
    the row is one sequence in which the decay at every sequence start is e^{-1e4} = 0: the delta rule then
    restarts from a zero state there, which is exactly what running each sequence separately does (the first
    token's own decay multiplies a zero state, so its gradient is 0 either way), and the graph keeps plain torch
    ops. Otherwise the operator ``transformers_k3::kda_chunk`` (:mod:`.autograd`) takes ``cu_seqlens`` as a
    tensor and reads it when it runs: the fused kernel's forward where eager runs it, else the PyTorch path on the
    host bounds, and in both cases the PyTorch path's recomputed gradient.
    """
    fused = kernel and (cpu_kernel.applies(q, k, v, g, beta, state) or autograd.applies(q, k, v, g, beta, state))
    if not zero_start or (fused and cpu_kernel.library() is not None):
        return autograd.kda_chunk(q, k, v, g, beta, state, cu_seqlens, scale, chunk, fused)
    length = q.shape[1]
    edges = assert_cu_seqlens(cu_seqlens.to(device=q.device, dtype=torch.long), length)
    # (a start at T belongs to an empty last sequence; slot T is dropped)
    starts = torch.zeros(length + 1, dtype=torch.bool, device=q.device).index_fill(0, edges, True)[:length]
    g = torch.where(starts[None, :, None, None], torch.tensor(_RESET_LOG_DECAY, dtype=g.dtype, device=g.device), g)
    zero = state.new_zeros(1, *state.shape[1:])
    layout = Layout(1, length, None, chunk, q.device)
    return chunked(q, k, v, g, beta[..., None], zero, layout, scale)[0], None
