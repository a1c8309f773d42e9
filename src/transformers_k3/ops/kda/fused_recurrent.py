"""Token-by-token KDA in PyTorch: one decode step (:func:`single_token`) and the token loop over packed sequences
(:func:`recurrent`). Per step one product with the state: with ``d = e^{g_t}``, the decayed state's reads are
``(d k)^T S`` and ``(d q)^T S`` of the old state, and the output of the updated state follows as
``(d q)^T S + (k . q) delta``."""

from __future__ import annotations

import torch

from .layout import needs_grad, serial_if_small

__all__ = ["recurrent", "single_token"]


def single_token(q, k, v, g, beta, state, write: bool):
    """One token per sequence: ``q`` (scaled), ``k``, ``g`` ``[B, H, K]``, ``v`` ``[B, H, V]``, ``beta`` ``[B, H]``,
    ``state`` ``[B, H, K, V]``. The products of one step of `recurrent`: ``[(d k)^T S; (d q)^T S]`` in one batched
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
    elif needs_grad(q, k, v, g, beta, state):
        new = torch.addcmul(s * d, k_col, delta_row).view_as(state)
    else:
        new = (s * d).addcmul_(k_col, delta_row).view_as(state)
    return out.view(batch, heads, -1), new


def recurrent(q, k, v, g, beta, state, layout):
    """Token loop over packed ``[slots, H, 1, D]`` inputs (``q`` already scaled) from the rank-ordered
    states ``[N, H, K, V]``; returns ``[slots, H, 1, V]`` outputs and the rank-ordered final states.

    Per step it needs one product with the state: with ``d = e^{g_t}``, the decayed state's reads are
    ``(d k)^T S`` and ``(d q)^T S`` of the *old* state, one ``[2, K] x [K, V]`` product, and the output
    of the updated state follows as ``(d q)^T S + (k . q) delta``. Everything per-token that does not
    touch the state is computed for all tokens before the loop."""
    n_slots, heads, _, key_dim = k.shape
    value_dim = v.shape[-1]
    in_place = not needs_grad(q, k, v, g, beta, state)
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
    with serial_if_small(state[:1].numel() * (layout.active[0] if layout.active else 0)):
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


