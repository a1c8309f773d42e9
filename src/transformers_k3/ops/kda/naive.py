"""Slow, obviously-correct Kimi Delta Attention: the recurrence of spec section 4.6 written token by
token, one sequence at a time, with no algebraic rewriting.

It exists so the fast paths in :mod:`transformers_k3.ops.kda.interface` can be checked against something whose
correctness is evident from reading it (in addition to fla's own naive reference). Do not use it for
real work.
"""

from __future__ import annotations

import torch

__all__ = ["naive_recurrent_kda"]


def naive_recurrent_kda(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference KDA with fla's conventions.

    Shapes: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` (``HV`` a multiple of ``H``), ``g [B, T, HV, K]``
    log-decays, ``beta [B, T, HV]`` (post-sigmoid), ``initial_state [N, HV, K, V]``. With ``cu_seqlens``
    (``B == 1``) each packed sequence starts from its own initial state. Computes in fp32 (float64 if
    any input is float64); returns ``o`` in ``v``'s dtype and the final state in the compute dtype.

    Per head and token: ``S <- diag(exp(g_t)) S``; ``S <- S + beta_t k_t (v_t - S^T k_t)^T``;
    ``o_t = S^T (scale * q_t)`` (the post-update state).
    """
    dtype = torch.float32
    for t in (q, k, v, g, beta):
        dtype = torch.promote_types(dtype, t.dtype)
    batch, length, heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2], v.shape[3]
    if scale is None:
        scale = key_dim**-0.5
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q.repeat_interleave(v_heads // heads, dim=2) * scale
    k = k.repeat_interleave(v_heads // heads, dim=2)

    if cu_seqlens is None:
        segments = [(b, 0, length) for b in range(batch)]
    else:
        bounds = cu_seqlens.tolist()
        segments = [(0, start, end) for start, end in zip(bounds, bounds[1:])]

    outputs = torch.zeros(batch, length, v_heads, value_dim, dtype=dtype, device=v.device)
    finals = []
    for n, (b, start, end) in enumerate(segments):
        state = torch.zeros(v_heads, key_dim, value_dim, dtype=dtype, device=v.device)
        if initial_state is not None:
            state = state + initial_state[n].to(dtype)
        for t in range(start, end):
            state = state * g[b, t].exp()[:, :, None]
            prediction = torch.einsum("hk,hkv->hv", k[b, t], state)
            correction = beta[b, t][:, None] * (v[b, t] - prediction)
            state = state + k[b, t][:, :, None] * correction[:, None, :]
            outputs[b, t] = torch.einsum("hk,hkv->hv", q[b, t], state)
        finals.append(state)
    final_state = torch.stack(finals) if output_final_state else None
    return outputs.to(v.dtype), final_state
