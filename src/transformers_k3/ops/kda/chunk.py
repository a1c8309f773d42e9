"""Chunked KDA in PyTorch: the WY/UT-transform algorithm (see docs/kernels.md for the derivation).

All per-chunk work (decay-masked ``K K^T`` and ``Q K^T``, the unit-lower-triangular solve, ``w``/``u``) is batched over
every chunk, head and sequence at once; only the state hand-off between consecutive chunks is a Python loop. Decays
never overflow: a chunk is cut into 16-token sub-chunks, exponents are taken relative to a sub-chunk's middle token
where its decay span allows, and between sub-chunks decays split into factors that are all <= 1 (:func:`_intra_chunk`).
Values that would be subnormal floats (slow on x86) are set to 0 where they arise, and the triangular solve, which
chains decays, runs in float64.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .layout import Layout, needs_grad, serial_if_small

__all__ = ["TORCH_CHUNK_SIZE", "chunked", "chunked_reference"]

# Default chunk size of the PyTorch path: on CPU the intra-chunk matrices shrink with the chunk while the state work
# per token does not.
TORCH_CHUNK_SIZE = 32

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


def chunked_reference(q, k, v, g, beta, state, bounds, scale, chunk, group_elements=_GROUP_ELEMENTS):
    """The chunked path on plain arguments (``q`` not yet scaled, ``beta`` ``[B, T, H]``, ``state`` ``[N, H, K, V]``
    in sequence order, ``bounds`` the packed sequences' host bounds or None): ``(o [B, T, H, V], final [N, H, K,
    V])``, sequence order. Differentiable when its inputs require grad (then it runs the out-of-place code)."""
    batch, length = q.shape[:2]
    layout = Layout(batch, length, bounds, chunk, q.device)
    o, final = chunked(q, k, v, g, beta[..., None], layout.sort_states(state.contiguous()), layout, scale,
                       group_elements=group_elements)
    return o, layout.unsort_states(final)


def chunked(q, k, v, g, beta, state, layout, scale, gate_bound=None, group_elements=_GROUP_ELEMENTS):
    """WY/UT-transform chunked KDA over ``[B, T, H, D]`` inputs (``q`` not yet scaled, ``beta`` ``[B, T, H, 1]``)
    from the rank-ordered states ``[N, H, K, V]``; returns ``[B, T, H, V]`` outputs and the rank-ordered final
    states. ``gate_bound``: a bound on ``|g|`` the caller guarantees (:func:`_gate_bound`), which a traced graph
    uses to decide whether to factor its sub-chunks' decays. ``group_elements``: the elements per ``[rows, C, D]``
    tensor a group of steps holds (below).

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
    in_place = not needs_grad(q, k, v, g, beta, state)
    sub = _SUB_CHUNK
    while chunk % sub:
        sub //= 2
    group = max(1, group_elements // (chunk * max(key_dim, value_dim)))
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
        with serial_if_small(serial_size):
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


def _exp_cut(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)``, but exactly 0 at or below ``e^_EXP_CUTOFF``, so no subnormal floats enter later
    products. Clamping first keeps ``exp`` on its fast path: vectorised exp slows down sharply on
    inputs whose result underflows (or is -inf)."""
    return F.threshold(x.clamp(min=_EXP_CUTOFF).exp(), _EXP_FLOOR, 0.0)
