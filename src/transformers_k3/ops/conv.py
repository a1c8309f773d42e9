"""Depthwise causal short convolution used on KDA's q/k/v projections (spec section 4.2).

Each channel is convolved with its own width-``W`` filter (``W = 4`` in K3, no bias) over the last
``W`` raw inputs, then optionally passed through SiLU. The maths is done in fp32 because the
checkpoint keeps these weights in fp32 while activations are usually bf16; results are cast back to
the input dtype.

The convolution cache ("conv state") holds the last ``W - 1`` *raw* (pre-convolution) inputs per
channel, oldest first, as ``[B, D, W - 1]``. ``causal_conv1d`` is the prefill form (whole prompt,
optionally several packed sequences); ``causal_conv1d_update`` is the decode form that advances an
existing cache in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "causal_conv1d_update"]

_ACTIVATIONS = (None, "silu", "swish")


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> torch.Tensor:
    """Check ``x [B, T, D]``, the activation and the weight; accept both ``[D, W]`` and the ``nn.Conv1d`` layout
    ``[D, 1, W]`` so layers can pass their parameter as is; return ``[D, W]``."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got shape {tuple(x.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    channels = x.shape[-1]
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(
            f"weight must have shape [D, W] (or [D, 1, W]) with D = {channels} channels matching x's last dim, "
            f"got {tuple(weight.shape)}"
        )
    if weight.shape[1] < 1:
        raise ValueError(f"weight must have a kernel width W >= 1, got shape {tuple(weight.shape)}")
    return weight


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation is not None else y


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # fp32 at least (bf16 activations, fp32 weights); float64 stays float64 so gradcheck works.
    return torch.promote_types(x.dtype, torch.float32)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise convolution over a whole prompt (prefill).

    Args:
        x: ``[B, T, D]`` raw projections.
        weight: ``[D, W]`` (or ``[D, 1, W]``) per-channel filters; ``y_t = sum_j w[:, j] * x_{t - W + 1 + j}``.
        activation: ``"silu"`` (``"swish"`` is an alias) or ``None``.
        initial_state: ``[N, D, W - 1]``: the ``W - 1`` raw inputs that precede each sequence, oldest
            first; zeros when ``None`` (sequence start). ``N = B``, or the number of packed sequences.
        output_final_state: also return the cache to continue from.
        cu_seqlens: ``[N + 1]`` cumulative lengths of sequences packed along T (requires ``B == 1``); the
            window restarts at every sequence start, so packed sequences never see each other.

    Returns:
        ``(y, final_state)``: ``y`` is ``[B, T, D]`` in ``x``'s dtype; ``final_state`` is ``[N, D, W - 1]``
        in ``x``'s dtype holding the last ``W - 1`` raw inputs of each sequence (including the tail of
        ``initial_state`` when the sequence is shorter than ``W - 1``), or ``None``.
    """
    weight = _check_inputs(x, weight, activation)
    batch, length, channels = x.shape
    width = weight.shape[1]
    history = width - 1
    dtype = _compute_dtype(x)
    kernel = weight.to(dtype)[:, None, :]

    if cu_seqlens is None:
        n_seq = batch
    else:
        if batch != 1:
            raise ValueError(
                f"cu_seqlens packs sequences along T and needs x with batch size 1, got B = {batch}; "
                "flatten the batch to [1, total_tokens, D] first"
            )
        edges = _check_cu_seqlens(cu_seqlens, length, x.device)
        n_seq = edges.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (n_seq, channels, history):
        raise ValueError(
            f"initial_state must have shape [N, D, W - 1] = {(n_seq, channels, history)}, got "
            f"{tuple(initial_state.shape)}"
        )

    xt = x.to(dtype).transpose(1, 2)  # [B, D, T]
    if cu_seqlens is None:
        if initial_state is None:
            padded = F.pad(xt, (history, 0))
        else:
            padded = torch.cat([initial_state.to(dtype), xt], dim=-1)
        y = F.conv1d(padded, kernel, groups=channels) if length else xt
        final = padded[..., padded.shape[-1] - history :] if output_final_state else None
    else:
        y, final = _conv_varlen(xt[0], kernel, edges, initial_state, history, output_final_state)
    y = _activate(y, activation).transpose(1, 2).to(x.dtype)
    # contiguous(): a bare slice would keep the whole padded prompt alive for as long as the cache lives
    return y, (final.to(x.dtype).contiguous() if final is not None else None)


def _check_cu_seqlens(cu_seqlens: torch.Tensor, length: int, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` checked, as int64 on ``device``. Under torch.compile its values are checked by the graph
    itself (:func:`assert_cu_seqlens`): reading them on the host would break it."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N + 1] with N >= 1, got {cu_seqlens!r}")
    if torch.compiler.is_compiling():
        return assert_cu_seqlens(cu_seqlens.to(device=device, dtype=torch.long), length)
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != length or any(b > e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at T = {length}, got {bounds}"
        )
    return torch.tensor(bounds, device=device)


def assert_cu_seqlens(edges: torch.Tensor, length) -> torch.Tensor:
    """``edges`` (packed bounds, a tensor), after a check inside the computation that they start at 0, do not
    decrease and end at ``length``: a RuntimeError when it runs (no host read, so a compiled graph keeps it; on
    CUDA it does not wait for the device)."""
    ok = (edges[0] == 0) & (edges[-1] == length) & (edges[1:] >= edges[:-1]).all()
    torch._assert_async(ok, "cu_seqlens must start at 0, be non-decreasing and end at T, the packed row's length; "
                            "build it from the batch's sequence lengths")  # fmt: skip
    return edges


def _conv_varlen(
    xt: torch.Tensor,
    kernel: torch.Tensor,
    edges: torch.Tensor,
    initial_state: torch.Tensor | None,
    history: int,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One convolution over all packed sequences: each sequence gets its own ``W - 1`` history columns
    (zeros or its initial state) in front of it, so no window straddles two sequences and no sequence
    is padded to the longest. ``edges`` is the int64 ``cu_seqlens`` on ``xt``'s device; only tensor ops read it, so
    a traced graph (where the number of sequences may be an unbacked size) holds the same computation."""
    channels, length = xt.shape
    n_seq = edges.numel() - 1
    device = xt.device
    starts, ends = edges[:-1], edges[1:]
    lengths = ends - starts
    seq_of_token = torch.repeat_interleave(torch.arange(n_seq, device=device), lengths, output_size=length)
    token_col = torch.arange(length, device=device) + (seq_of_token + 1) * history
    offsets = torch.arange(history, device=device)
    # History column j of sequence i sits at starts[i] + i * history + j.
    history_col = (starts + torch.arange(n_seq, device=device) * history)[:, None] + offsets

    packed = xt.new_zeros(channels, length + n_seq * history)
    packed = packed.index_copy(1, token_col, xt)
    if initial_state is not None:
        packed = packed.index_copy(
            1, history_col.reshape(-1), initial_state.to(xt.dtype).permute(1, 0, 2).reshape(channels, -1)
        )
    if length:
        conv = F.conv1d(packed[None], kernel, groups=channels)[0]  # output c reads columns c .. c + history
        y = conv.index_select(1, token_col - history)[None]
    else:
        y = xt[None]
    final = None
    if output_final_state:
        last_cols = (ends + torch.arange(n_seq, device=device) * history)[:, None] + offsets
        final = packed.index_select(1, last_cols.reshape(-1)).view(channels, n_seq, history).permute(1, 0, 2)
    return y, final


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Advance the convolution by a few tokens (decode / speculative verify) and update the cache.

    Args:
        x: ``[B, T, D]`` new raw inputs (``T`` small, typically 1).
        conv_state: ``[B, D, W - 1]`` cache of the previous raw inputs, oldest first. Overwritten **in
            place** with the last ``W - 1`` raw inputs (cast to its own dtype), so a cache tensor held by
            the caller stays valid without reassignment.
        weight: ``[D, W]`` (or ``[D, 1, W]``).
        activation: ``"silu"``/``"swish"`` or ``None``.

    Returns:
        ``[B, T, D]`` in ``x``'s dtype.
    """
    weight = _check_inputs(x, weight, activation)
    batch, _, channels = x.shape
    width = weight.shape[1]
    if tuple(conv_state.shape) != (batch, channels, width - 1):
        raise ValueError(
            f"conv_state must have shape [B, D, W - 1] = {(batch, channels, width - 1)}, got {tuple(conv_state.shape)}"
        )
    dtype = _compute_dtype(x)
    window = torch.cat([conv_state.to(dtype), x.to(dtype).transpose(1, 2)], dim=-1)  # [B, D, W - 1 + T]
    # For a handful of tokens an unfolded multiply-add beats launching a convolution.
    y = (window.unfold(-1, width, 1) * weight.to(dtype)[:, None, :]).sum(-1)  # [B, D, T]
    conv_state.copy_(window[..., window.shape[-1] - (width - 1) :])
    return _activate(y, activation).transpose(1, 2).to(x.dtype)
