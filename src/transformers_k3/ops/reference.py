"""The ``transformers_k3::*`` operators of the fused CPU kernels (``csrc/torch_ops.cpp``) in plain PyTorch, for every
device without a kernel of its own (CUDA, XPU, MPS, ...): registered as each operator's CompositeExplicitAutograd
implementation, so a graph or an exported program holding the operators also runs there. The CPU kernels keep the
CPU (a backend's kernel takes precedence), the fake implementations the meta device.

Each function computes the operator's contract as its Python wrapper in `cpu_kernel` states it, in the operands'
own device: the same quantities, with the sums in torch's order (the kernels' differ by fp32 rounding). The
backward operators differentiate these forwards with autograd, so their gradients are the forwards' exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mxfp4_torch import mxfp4_grouped_mm, mxfp4_grouped_mm_backward  # (the packed MXFP4 experts' operators)
from .experts import eager_experts
from .mxfp4 import mxfp4_experts
from .torch_internals import autograd_inside_operator


def _none(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0, dtype=torch.float32)  # (an output not asked for)


def _grads(outputs, cotangents, inputs, mask):
    """``torch.autograd.grad`` of ``outputs`` for ``cotangents`` with respect to the ``inputs`` ``mask`` asks for:
    zeros for a wanted input the outputs do not depend on, an empty fp32 tensor for one not asked for."""
    wanted = [x for x, m in zip(inputs, mask) if m]
    found = torch.autograd.grad(outputs, wanted, cotangents, allow_unused=True) if wanted else ()
    found = iter(found)
    results = []
    for x, m in zip(inputs, mask):
        if not m:
            results.append(_none(x))
            continue
        grad = next(found)
        results.append((torch.zeros_like(x) if grad is None else grad).contiguous())
    return tuple(results)


# -- KDA -----------------------------------------------------------------------------------------------------------


def kda_chunk_forward(q, k, v, g, beta, state, starts, lengths, chunk: int, scale: float) -> torch.Tensor:
    """Each sequence ``i`` (tokens ``starts[i] : starts[i] + lengths[i]`` of the ``B T`` flattened ones) from
    ``state[i]``, which receives its final state; ``q`` not yet scaled. Tokens in no sequence give zeros."""
    from .kda.chunk import chunked_reference  # (imported when it runs: the KDA package imports this module)

    batch, length, heads, _ = q.shape
    flat = [x.reshape(1, batch * length, *x.shape[2:]) for x in (q, k, v, g, beta)]
    out = q.new_zeros((1, batch * length, heads, v.shape[-1]))
    for i, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        if not 0 <= start <= start + n <= batch * length:
            raise RuntimeError(f"kda_chunk_forward: sequence {i} (start {start}, length {n}) lies outside the "
                               f"{batch * length} tokens")  # fmt: skip
        if n == 0:
            continue
        part = [x[:, start : start + n] for x in flat]
        o, final = chunked_reference(*part, state[i : i + 1], None, scale, chunk)
        out[:, start : start + n] = o
        state[i].copy_(final[0])
    return out.view(batch, length, heads, v.shape[-1])


# -- the router ----------------------------------------------------------------------------------------------------


def router_topk(scores, bias, top_k: int) -> torch.Tensor:
    """The ``k`` largest ``scores + bias`` per row in descending order, ties to the lower id, NaN first."""
    return torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :top_k].contiguous()


def router_sigmoid_topk(logits, bias, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.sigmoid(logits)
    index = router_topk(scores, bias, top_k)
    return index, scores.gather(1, index)


def sigmoid(x) -> torch.Tensor:
    return torch.sigmoid(x)


def selected_scores(hidden_states, weight, top_k_index, selected) -> torch.Tensor:
    return selected.clone()


def router_backward(grad, hidden_states, weight, top_k_index, selected, need_hidden: bool, need_weight: bool):
    """The gradient of ``sigmoid(hidden_states weight^T)`` gathered at ``top_k_index``."""
    with autograd_inside_operator(), torch.enable_grad():
        h = hidden_states.detach().requires_grad_(need_hidden)
        w = weight.detach().requires_grad_(need_weight)
        chosen = torch.sigmoid(h @ w.t()).gather(1, top_k_index)
        if not (need_hidden or need_weight):
            return _none(h), _none(w)
        return _grads([chosen], [grad], [h, w], [need_hidden, need_weight])


def router_screened_topk(hidden_states, weight, bias, top_k: int, screen: bool):
    return router_sigmoid_topk(hidden_states @ weight.t(), bias, top_k)


# -- linear layers -------------------------------------------------------------------------------------------------


def gemm_bf16_f32(x, weight) -> torch.Tensor:
    return x.float() @ weight.float().t()


def linear_bf16(x, weight, bias) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


# -- GLU and RMSNorm -----------------------------------------------------------------------------------------------


def _glu32(gate: torch.Tensor, up: torch.Tensor, kind: int, beta: float, linear_beta: float) -> torch.Tensor:
    """``kind`` 0: ``silu(gate) up``; 1: SiTU, ``beta tanh(gate / beta) sigmoid(gate)`` times ``linear_beta
    tanh(up / linear_beta)`` (``linear_beta`` 0: ``up``), on fp32 operands."""
    if kind == 0:
        return F.silu(gate) * up
    gate_factor = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    return gate_factor * (up if linear_beta == 0 else linear_beta * torch.tanh(up / linear_beta))


def glu(gate, up, kind: int, beta: float, linear_beta: float) -> torch.Tensor:
    return _glu32(gate.float(), up.float(), kind, beta, linear_beta).to(gate.dtype)


def glu_backward(grad, gate, up, kind: int, beta: float, linear_beta: float):
    with autograd_inside_operator(), torch.enable_grad():
        a, u = gate.detach().float().requires_grad_(), up.detach().float().requires_grad_()
        grad_a, grad_u = torch.autograd.grad(_glu32(a, u, kind, beta, linear_beta), [a, u], grad.float())
    return grad_a.to(gate.dtype), grad_u.to(gate.dtype)


def rms_norm(hidden_states, weight, eps: float) -> torch.Tensor:
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), eps=eps) * weight


def rms_norm_backward(grad, hidden_states, weight, eps: float):
    with autograd_inside_operator(), torch.enable_grad():
        x, w = hidden_states.detach().requires_grad_(), weight.detach().requires_grad_()
        grad_x, grad_w = torch.autograd.grad(rms_norm(x, w, eps), [x, w], grad.float())
    return grad_x.contiguous(), grad_w.contiguous()


# -- the routed experts and the whole MoE layer --------------------------------------------------------------------


def _experts32(x, index, weights, gate_up, down, transposed: bool, kind: int, beta: float, linear_beta: float,
               products: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The eager routed experts (`experts.eager_experts`) in fp32 from the values as given: ``out[t] = sum_j
    weights[t, j] down_e(glu(gate_up_e(x[t])))`` with ``e = index[t, j]`` (ids outside ``[0, E)`` contribute
    nothing); ``products`` receives each (token, slot)'s ``gate_up_e(x[t])`` row (token-major)."""
    gate_up32, down32 = gate_up.float(), down.float()
    if transposed:  # (stored [E, D, 2I] / [E, I, D])
        gate_up32, down32 = gate_up32.transpose(1, 2), down32.transpose(1, 2)
    inter = gate_up32.shape[1] // 2

    def apply_gate(projected: torch.Tensor) -> torch.Tensor:
        return _glu32(projected[:, :inter], projected[:, inter:], kind, beta, linear_beta)

    return eager_experts(x.float(), index.long(), weights.float(), gate_up32, down32, apply_gate, products)


def moe_experts(x, index, weights, gate_up, down, transposed: bool, kind: int, beta: float, linear_beta: float,
                small: bool, save_products: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    inter = gate_up.shape[2 if transposed else 1] // 2
    save = small and save_products
    products = x.new_zeros((index.numel(), 2 * inter), dtype=torch.float32) if save else _none(x)
    out = _experts32(x, index, weights, gate_up, down, transposed, kind, beta, linear_beta,
                     products if save else None)  # fmt: skip
    return out.to(x.dtype), products


def moe_experts_backward(grad_out, x, index, weights, gate_up, down, products, transposed: bool, kind: int,
                         beta: float, linear_beta: float, small: bool, output_mask: list[bool]):  # fmt: skip
    """The gradients for ``x, weights, gate_up, down`` (each in its own dtype: fp32 sums, rounded once) that
    ``output_mask`` asks for; ``products`` is recomputed."""
    with autograd_inside_operator(), torch.enable_grad():
        leaves = [t.detach().requires_grad_(m) for t, m in zip((x, weights, gate_up, down), output_mask)]
        out = _experts32(leaves[0], index, *leaves[1:], transposed, kind, beta, linear_beta)
        if not out.requires_grad:
            return tuple(torch.zeros_like(t) if m else _none(x) for t, m in zip(leaves, output_mask))
        grads = _grads([out], [grad_out.float()], leaves, output_mask)
    return tuple(g if not m else g.to(t.dtype) for g, t, m in zip(grads, leaves, output_mask))


def moe_decode(y, router, bias, top_k: int, renormalize: bool, scale: float, down_latent, norm, eps: float,
               up_latent, gate_up, down, kind: int, beta: float, linear_beta: float, shared_gate, shared_up,
               shared_down) -> torch.Tensor:  # fmt: skip
    """The MoE layer as its modules compute it (`KimiK3SparseMoE`): the fp32 sigmoid router's top-k of the biased
    scores, the chosen scores renormalised and scaled, the latent projection, the routed experts (fp32, rounded
    once), the latent norm and projection back, plus the shared expert, each linear layer in ``y``'s dtype."""

    def experts(x, index, weights):
        return _experts32(x, index, weights, gate_up, down, False, kind, beta, linear_beta).to(y.dtype)

    return _decode(y, router, bias, top_k, renormalize, scale, down_latent, norm, eps, up_latent, experts, kind, beta,
                   linear_beta, shared_gate, shared_up, shared_down)  # fmt: skip


def moe_decode_mxfp4(y, router, bias, top_k: int, renormalize: bool, scale: float, down_latent, norm, eps: float,
                     up_latent, gate_up_packed, gate_up_scale, down_packed, down_scale, kind: int, beta: float,
                     linear_beta: float, shared_gate, shared_up, shared_down) -> torch.Tensor:  # fmt: skip
    """`moe_decode` with packed MXFP4 routed experts, as the packed experts' modules compute them
    (`mxfp4.mxfp4_experts` on the PyTorch products: in ``y``'s dtype, the GLU in fp32 rounded once)."""
    def experts(x, index, weights):
        def apply_gate(gate_up):
            inter = gate_up.shape[-1] // 2
            return glu(gate_up[:, :inter], gate_up[:, inter:], kind, beta, linear_beta)

        return mxfp4_experts(x, index, weights, gate_up_packed, gate_up_scale, down_packed, down_scale, apply_gate,
                             kernel=False)  # fmt: skip

    return _decode(y, router, bias, top_k, renormalize, scale, down_latent, norm, eps, up_latent, experts, kind, beta,
                   linear_beta, shared_gate, shared_up, shared_down)  # fmt: skip


def _decode(y, router, bias, top_k, renormalize, scale, down_latent, norm, eps, up_latent, experts, kind, beta,
            linear_beta, shared_gate, shared_up, shared_down) -> torch.Tensor:  # fmt: skip
    """The layer around its routed experts, ``experts(x, index, weights) -> [N, D]`` in ``y``'s dtype."""
    index, selected = router_sigmoid_topk(y.float() @ router.float().t(), bias, top_k)
    if renormalize:
        selected = selected / (selected.sum(dim=-1, keepdim=True) + 1e-20)
    routed_in = y if down_latent is None else F.linear(y, down_latent)
    routed = experts(routed_in, index, selected * scale)
    if norm is not None:
        routed = (F.rms_norm(routed.float(), (routed.shape[-1],), eps=eps) * norm.float()).to(y.dtype)
    if up_latent is not None:
        routed = F.linear(routed, up_latent)
    if shared_gate is not None:
        gate, up = F.linear(y, shared_gate), F.linear(y, shared_up)
        act = F.silu(gate) * up if kind == 0 else glu(gate, up, kind, beta, linear_beta)
        routed = routed + F.linear(act, shared_down)
    return routed


def latent_scores(latent, queries):
    """``queries @ latent^T`` ``[B, M, S]`` in fp32 (bf16 products are exact in fp32)."""
    return torch.matmul(queries.float(), latent.float().transpose(1, 2)).contiguous()


def latent_attention(latent, queries, scale, value_dim, new_tokens, mask=None):
    """``softmax(scale queries latent^T) latent[..., :value_dim]`` in fp32, the query rows head-major over the
    ``new_tokens`` new tokens; the rows each sees: a boolean ``mask`` ``[B or 1, heads or 1, T, S]``, else those up
    to its own, the new tokens the latent's last. The others' logits are the lowest fp32 (a query that sees no row
    gets the mean of all of them, as a masked softmax does)."""
    batch, rows, seq = queries.shape[0], queries.shape[1], latent.shape[1]
    scores = torch.matmul(queries.float(), latent.float().transpose(1, 2)) * scale
    if mask is None:
        mask = torch.ones(new_tokens, seq, dtype=torch.bool, device=latent.device).tril(seq - new_tokens)
    scores = scores.view(batch, rows // new_tokens, new_tokens, seq).masked_fill(~mask, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores.view(batch, rows, seq), dim=-1)
    return torch.matmul(probs, latent[..., :value_dim].float())


OPERATORS = (
    "kda_chunk_forward", "router_topk", "router_sigmoid_topk", "sigmoid", "selected_scores", "router_backward",
    "router_screened_topk", "gemm_bf16_f32", "latent_scores", "latent_attention", "linear_bf16", "glu",
    "glu_backward", "rms_norm", "rms_norm_backward", "moe_experts", "moe_experts_backward", "moe_decode",
    "moe_decode_mxfp4", "mxfp4_grouped_mm", "mxfp4_grouped_mm_backward",
)  # fmt: skip


def register() -> None:
    """Each operator's function above as its CompositeExplicitAutograd implementation (every device but the CPU,
    whose kernel is the fused one, and meta, whose is the fake)."""
    for name in OPERATORS:
        torch.library.impl(f"transformers_k3::{name}", "CompositeExplicitAutograd")(globals()[name])
