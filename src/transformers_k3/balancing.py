r"""Quantile Balancing: keeping K3's 896 experts evenly loaded through the router's selection bias.

K3's router picks the top-k experts of ``s + b`` (sigmoid scores ``s`` plus the per-expert
``e_score_correction_bias`` ``b``) but weights them with the unbiased ``s`` (spec 6.3). ``b`` is not
learned by gradient descent: a training-side rule moves it after every optimizer step so that every
expert is chosen about equally often. The K3 paper calls its rule *Quantile Balancing* and describes it
only as "a top-(k+1) cutoff, a per-expert quantile, mean-centred" that is "more robust than mean and
variance". This module makes that precise as follows (our derivation; the spec gives no formula).

The rule
--------
One MoE layer, ``E`` experts, top-``k``, ``N`` tokens seen during one optimizer step (all micro-batches,
all data-parallel ranks). ``s'_{t,e} = s_{t,e} + b_e``; ``c_t^{(1)} >= ... >= c_t^{(k+1)}`` are the
``k+1`` largest values of ``s'_t`` (the *top-(k+1) cutoff*).

1. **Selection margin.** For token ``t`` and expert ``e``::

       m_{t,e} = s'_{t,e} - kappa_{t,e},   kappa_{t,e} = c_t^{(k+1)} if e is in the top-k of t, else c_t^{(k)}

   ``kappa_{t,e}`` is the k-th largest biased score among the *other* experts, so it does not depend on
   ``b_e``. Hence ``e`` is selected at ``t`` iff ``m_{t,e} > 0``, and shifting ``b_e`` by ``delta`` (the
   other biases fixed) shifts every ``m_{t,e}`` by exactly ``delta``: expert ``e``'s load becomes
   ``n_e(delta) = #{t : m_{t,e} + delta > 0}``.

2. **Per-expert quantile.** Perfect balance is a load of ``q N`` tokens per expert with ``q = k / E``.
   The shift that gives expert ``e`` exactly that load is ``delta_e = -Q_e``, where ``Q_e`` is the
   ``(1 - q)``-quantile of ``{m_{t,e}}_t``: the value with exactly ``q N`` margins above it (linear
   interpolation between order statistics).

3. **Mean-centred update.** ``Delta b_e = eta * (delta_e - mean_j delta_j)``, ``b <- b + Delta b``.
   Adding one constant to every bias changes no selection, so centring costs nothing; it keeps
   ``sum_e b_e = 0`` and stops the biases from drifting together. ``eta`` (``update_rate``, default 1) damps
   the joint move: each ``delta_e`` is solved with the other biases held fixed, and all experts move at
   once (a Jacobi step). ``eta = 1`` takes the full step: on a strongly skewed synthetic router
   (64 experts, top-4, 4,096 tokens a step, max/mean load 6.4 with 12 dead experts) max/mean goes
   6.4 -> 1.49 -> 1.22 -> 1.13 and then stays at the sampling-noise level (1.1-1.3), no expert dead.

Why quantiles: the update depends only on the order statistics of the margins around the target
quantile, so a few tokens with extreme scores cannot move it (a mean/variance rule would follow them);
and the step size comes from the data: a dead expert whose best margins are ``-0.3`` jumps by about
``0.3`` in one step, a slightly overloaded one moves slightly, where DeepSeek-V3's sign rule
(``Delta b_e = gamma * sign(mean load - load_e)``, available here as ``method="sign"``) moves every expert
by the same ``gamma`` and needs ``|b| / gamma`` steps to get anywhere.

Accumulation and data parallelism
---------------------------------
Quantiles do not add up across micro-batches or ranks, histograms do. Each layer keeps, per expert, a
histogram of its margins on a fixed grid that is symmetric-logarithmic in the margin::

    u = asinh(m / margin_scale),  num_bins equal bins on [-U, U],  U = asinh(margin_max / margin_scale)

(margins beyond ``+-margin_max`` fall into the end bins, which caps one step at ``margin_max``). The
grid never depends on the data, so the counts of every micro-batch and every rank are simply summed (one
``all_reduce`` per optimizer step), and the result is *identical* to the histogram of the concatenated
data. ``Q_e`` is read off the summed histogram, interpolating linearly in ``u`` inside its bin. The bins
are relatively narrow everywhere (``2U / num_bins`` in ``u``, about 9% of ``|m|`` with the defaults) and
the interpolation brings the error on ``Delta b`` well under that; near balance ``|m|`` and therefore the
absolute error shrink with it. Memory: ``num_bins * E`` int32 counts per MoE layer (256 x 896 x 4 bytes
= 0.9 MiB per layer for K3).

Which tokens count: every token the router sees while the model is in training mode, padding included
(a padded token occupies an expert like any other). Forward passes in eval mode, and the re-run of the
forward that gradient checkpointing does during backward, are not counted.

Metrics (per MoE layer and optimizer step, over all micro-batches and ranks; the load is the one the
router actually produced with the biases in force during the step):

* ``maxvio``: ``max_e load_e / mean_e load_e - 1`` (0 when perfectly balanced);
* ``dead_experts``: experts selected by no token;
* ``router_entropy``: mean over tokens of the entropy (nats) of the normalised scores
  ``s_t / sum_e s_{t,e}``; ``log E`` when the router is indifferent, small when it is sharp.

Public API: `selection_margins`, `quantile_balancing_update` and `sign_balancing_update` (pure functions
of one batch of scores, for custom loops or analysis), `RouterBalancer` (forward hooks on every
`KimiK3Router` of a model, ``step()`` once per optimizer step) and `QuantileBalancingCallback` (the same
inside a `transformers.Trainer`, with the metrics in the Trainer logs). The optional auxiliary loss for
comparison is `router_aux_loss` (config ``router_aux_loss_coef``).
"""

from __future__ import annotations

import math
import re
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .modeling_kimi_k3 import KimiK3Router, router_aux_loss
from .ops.torch_internals import in_backward

__all__ = [
    "QuantileBalancingCallback",
    "ROUTER_BIASES_NAME",
    "RouterBalancer",
    "load_router_biases",
    "save_router_biases",
    "quantile_balancing_update",
    "router_aux_loss",
    "router_entropy",
    "selection_margins",
    "sign_balancing_update",
]

METHODS = ("quantile", "sign", None)
DEFAULT_UPDATE_RATE = {"quantile": 1.0, "sign": 1e-3}


# --------------------------------------------------------------------------------------------------
# Pure functions of one batch of router scores
# --------------------------------------------------------------------------------------------------


def selection_margins(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """``m [N, E]`` (fp32): how far each expert's biased score is above (> 0, selected) or below (<= 0)
    the k-th largest biased score of the other experts, from the top-(k+1) cutoff of ``scores + bias``.
    That threshold does not depend on ``bias[e]``, so shifting ``bias[e]`` by ``d`` (the other biases
    fixed) shifts column ``e`` by exactly ``d`` (see the module docstring)."""
    num_experts = scores.shape[-1]
    if not 0 < top_k < num_experts:
        raise ValueError(f"top_k must be in [1, num_experts - 1], got {top_k} for {num_experts} experts")
    biased = scores.reshape(-1, num_experts).float() + bias.float()
    top = biased.topk(top_k + 1, dim=-1).values  # sorted, descending
    kth, next_ = top[:, top_k - 1 : top_k], top[:, top_k : top_k + 1]
    return torch.where(biased >= kth, biased - next_, biased - kth)


def _quantile_from_top(margins: torch.Tensor, target: float) -> torch.Tensor:
    """Per column, the value with exactly ``target`` (fractional) entries above it: sorted descending
    ``v_0 >= v_1 >= ...``, linear interpolation at position ``target - 1/2`` (the midpoint of the
    ``target``-th and ``target+1``-th largest for an integer target)."""
    n = margins.shape[0]
    need = min(n, math.floor(target + 0.5) + 1)
    top = margins.topk(need, dim=0).values  # [need, E], descending
    pos = min(max(target - 0.5, 0.0), n - 1.0)
    lo = min(math.floor(pos), need - 1)
    hi = min(lo + 1, need - 1)
    frac = pos - lo
    return top[lo] * (1 - frac) + top[hi] * frac


def quantile_balancing_update(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, update_rate: float = 1.0, center: bool = True
) -> torch.Tensor:
    """The Quantile Balancing bias update ``Delta b [E]`` for one batch of router ``scores [N, E]`` (the
    sigmoid, or softmax, scores, before the bias) and the current ``bias [E]``: per expert, minus the
    ``(1 - k/E)``-quantile of its selection margins, mean-centred, times ``update_rate``. Exact order
    statistics (no histogram). Apply with ``bias += delta``. See the module docstring.

    ``center=False`` returns the raw per-expert shifts ``delta_e``: adding ``delta_e`` to ``bias[e]`` alone
    gives expert ``e`` a load of ``k N / E`` tokens on this batch."""
    margins = selection_margins(scores, bias, top_k)
    num_tokens, num_experts = margins.shape
    if num_tokens == 0:
        return torch.zeros(num_experts, dtype=torch.float32, device=margins.device)
    shift = -_quantile_from_top(margins, top_k / num_experts * num_tokens)
    return update_rate * (shift - shift.mean() if center else shift)


def _loads(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    num_experts = scores.shape[-1]
    chosen = (scores.reshape(-1, num_experts).float() + bias.float()).topk(top_k, dim=-1).indices
    return torch.bincount(chosen.reshape(-1), minlength=num_experts)


def sign_balancing_update(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, update_rate: float = 1e-3
) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free update, for comparison: ``update_rate * sign(mean load - load_e)``,
    mean-centred. ``scores [N, E]``, ``bias [E]`` -> ``Delta b [E]``."""
    return _sign_update(_loads(scores, bias, top_k).double(), update_rate)


def _sign_update(loads: torch.Tensor, update_rate: float) -> torch.Tensor:
    step = update_rate * torch.sign(loads.mean() - loads).float()
    return step - step.mean()


def router_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Per-token entropy (nats) of the normalised router scores ``s_t / sum_e s_{t,e}``; ``[N]``."""
    scores = scores.reshape(-1, scores.shape[-1]).float()
    p = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return -torch.special.xlogy(p, p).sum(dim=-1)


# --------------------------------------------------------------------------------------------------
# Accumulating over an optimizer step: forward hooks + histograms
# --------------------------------------------------------------------------------------------------


class _LayerStats:
    """What one router saw during the current optimizer step."""

    def __init__(self, num_experts: int, num_bins: int, device: torch.device, with_histogram: bool):
        self.hist = torch.zeros(num_experts * num_bins, dtype=torch.int32, device=device) if with_histogram else None
        # [loads (E), sum of per-token entropies, number of tokens]
        self.sums = torch.zeros(num_experts + 2, dtype=torch.float64, device=device)


class RouterBalancer:
    """Quantile Balancing (or the sign rule, or monitoring only) for every `KimiK3Router` in ``model``.

    Forward hooks record, for each router, a histogram of the selection margins, the expert loads and the
    router entropy of every training-mode forward. `step` (call it once per optimizer step, after
    ``optimizer.step()``) sums them over data-parallel ranks, updates every ``e_score_correction_bias``
    in place so that the next step routes with the new bias, and returns the step's metrics::

        balancer = RouterBalancer(model)
        for batch in loader:                 # any number of micro-batches per step
            loss = model(**batch).loss / accumulation
            loss.backward()
            if end_of_accumulation:
                optimizer.step(); optimizer.zero_grad()
                metrics = balancer.step()    # {"moe/layer_1/maxvio": ..., ...}

    ``method``: ``"quantile"`` (default), ``"sign"`` (DeepSeek-V3's fixed-size step) or ``None`` (metrics
    only, e.g. next to the auxiliary loss). ``update_rate``: ``eta`` of the quantile rule (default 1) or
    ``gamma`` of the sign rule (default 1e-3). ``num_bins``, ``margin_scale``, ``margin_max``: the margin
    histogram (module docstring). ``process_group``: the data-parallel group to sum over (default: the
    whole world when `torch.distributed` is initialised; every rank must call `step` together).
    """

    def __init__(
        self,
        model: nn.Module,
        method: str | None = "quantile",
        update_rate: float | None = None,
        num_bins: int = 256,
        margin_scale: float = 1e-4,
        margin_max: float = 4.0,
        process_group=None,
        router_class: type[nn.Module] = KimiK3Router,
    ):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if num_bins < 2 or num_bins % 2:
            raise ValueError(f"num_bins must be an even number >= 2, got {num_bins}")
        if not 0 < margin_scale < margin_max:
            raise ValueError("need 0 < margin_scale < margin_max")
        self.method = method
        self.update_rate = DEFAULT_UPDATE_RATE.get(method, 0.0) if update_rate is None else float(update_rate)
        self.num_bins = num_bins
        self.margin_scale = margin_scale
        self.half_width = math.asinh(margin_max / margin_scale)  # U
        self.process_group = process_group
        self.enabled = True

        self.routers: dict[str, nn.Module] = {}
        for name, module in model.named_modules():
            if isinstance(module, router_class):
                if getattr(module, "num_expert_group", 1) > 1 and method == "quantile":
                    warnings.warn(
                        "Quantile Balancing treats routing as plain top-k; with group-limited routing "
                        "(num_expert_group > 1) its margins ignore the group mask, so the update is approximate.",
                        stacklevel=2,
                    )
                self.routers[self._layer_key(name, len(self.routers))] = module
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no {router_class.__name__} to balance")
        self._stats: dict[str, _LayerStats] = {}
        self._handles = [
            module.register_forward_hook(self._make_hook(key)) for key, module in self.routers.items()
        ]
        self._count_observers(+1)  # (the routers' kernels keep their logits while the hooks read them)
        self.last_metrics: dict[str, float] = {}

    def _count_observers(self, step: int) -> None:
        for module in self.routers.values():
            if isinstance(getattr(module, "logits_observers", None), int):
                module.logits_observers += step

    @staticmethod
    def _layer_key(module_name: str, position: int) -> str:
        match = re.search(r"layers\.(\d+)\.", module_name)
        return f"layer_{match.group(1)}" if match else f"router_{position}"

    # -- recording ---------------------------------------------------------------------------------
    def _make_hook(self, key: str):
        def hook(module, args, output):
            if not (self.enabled and module.training) or in_backward():
                return
            router_logits, _, topk_indices = output
            self.observe(key, router_logits, topk_indices)

        return hook

    @torch.no_grad()
    def observe(self, key: str, router_logits: torch.Tensor, topk_indices: torch.Tensor | None = None) -> None:
        """Add one forward's router logits ``[N, E]`` (and the experts it chose, ``[N, k]``; recomputed from
        the bias when omitted) to router ``key``'s statistics. The hooks call this; call it yourself to feed
        logits that did not go through a hooked router."""
        router = self.routers[key]
        logits = router_logits.detach().float()
        num_experts = logits.shape[-1]
        logits = logits.reshape(-1, num_experts)
        scores = logits.softmax(dim=-1) if router.use_softmax else logits.sigmoid()
        bias = router.e_score_correction_bias
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = _LayerStats(num_experts, self.num_bins, logits.device, self.method == "quantile")

        if topk_indices is None:
            loads = _loads(scores, bias, router.top_k)
        else:
            flat = topk_indices.reshape(-1)
            loads = torch.bincount(flat[flat < num_experts], minlength=num_experts)
        stats.sums[:num_experts] += loads[:num_experts]
        stats.sums[num_experts] += router_entropy(scores).double().sum()
        stats.sums[num_experts + 1] += logits.shape[0]

        if stats.hist is not None:
            margins = selection_margins(scores, bias, router.top_k)
            u = torch.asinh(margins / self.margin_scale)
            bins = ((u + self.half_width) * (self.num_bins / (2 * self.half_width))).floor_()
            bins = bins.clamp_(0, self.num_bins - 1).long()
            bins += torch.arange(num_experts, device=bins.device) * self.num_bins
            stats.hist += torch.bincount(bins.reshape(-1), minlength=num_experts * self.num_bins).to(torch.int32)

    # -- the update ----------------------------------------------------------------------------------
    def _histogram_quantile(self, hist: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per row of ``hist [E, B]``, the margin with ``target`` (fractional) counts above it."""
        hist = hist.double()
        above = hist.flip(-1).cumsum(-1).flip(-1)  # above[:, j] = count in bins j..B-1
        above_next = above - hist  # count in bins j+1..B-1
        # the bin j that holds the threshold: above_next[j] < target <= above[j]
        inside = (above_next < target[:, None]) & (above >= target[:, None])
        j = torch.where(inside.any(-1), inside.double().argmax(-1), torch.zeros_like(target, dtype=torch.long))
        h = hist.gather(1, j[:, None]).squeeze(1)
        frac_from_top = ((target - above_next.gather(1, j[:, None]).squeeze(1)) / h.clamp_min(1e-300)).clamp(0, 1)
        width = 2 * self.half_width / self.num_bins
        u = -self.half_width + (j.double() + 1 - frac_from_top) * width
        return self.margin_scale * torch.sinh(u)

    @torch.no_grad()
    def step(self) -> dict[str, float]:
        """Sum this optimizer step's statistics over ranks, update every bias, reset, return the metrics
        (``moe/<layer>/{maxvio,dead_experts,router_entropy}`` plus ``moe/maxvio_max``,
        ``moe/dead_experts_total`` and ``moe/router_entropy_mean`` over layers). Layers that saw no token
        are left alone."""
        keys = list(self._stats)
        if self._distributed():
            keys = self._all_reduce(keys)
        metrics: dict[str, float] = {}
        for key in keys:
            stats, router = self._stats[key], self.routers[key]
            num_experts = stats.sums.numel() - 2
            loads, entropy_sum, tokens = stats.sums[:num_experts], stats.sums[num_experts], stats.sums[num_experts + 1]
            if tokens.item() == 0:
                continue
            mean_load = loads.mean()
            metrics[f"moe/{key}/maxvio"] = (loads.max() / mean_load - 1).item()
            metrics[f"moe/{key}/dead_experts"] = float((loads == 0).sum().item())
            metrics[f"moe/{key}/router_entropy"] = (entropy_sum / tokens).item()

            delta = None
            if self.method == "quantile":
                target = torch.full((num_experts,), router.top_k / num_experts, dtype=torch.float64,
                                    device=tokens.device) * tokens
                shift = -self._histogram_quantile(stats.hist.view(num_experts, self.num_bins), target)
                delta = self.update_rate * (shift - shift.mean())
            elif self.method == "sign":
                delta = _sign_update(loads, self.update_rate)
            if delta is not None:
                bias = router.e_score_correction_bias
                bias.add_(delta.to(bias.device, bias.dtype))
        self._stats.clear()
        if metrics:
            per = defaultdict(list)
            for name, value in metrics.items():
                per[name.rsplit("/", 1)[1]].append(value)
            metrics["moe/maxvio_max"] = max(per["maxvio"])
            metrics["moe/dead_experts_total"] = sum(per["dead_experts"])
            metrics["moe/router_entropy_mean"] = sum(per["router_entropy"]) / len(per["router_entropy"])
        self.last_metrics = metrics
        return metrics

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    def _all_reduce(self, keys: list[str]) -> list[str]:
        """Sum every layer's statistics over the ranks with one all-reduce per dtype. Every rank must hold
        the same layers, so a layer one rank did not see is allocated empty first (in router order)."""
        device = next(iter(self.routers.values())).e_score_correction_bias.device
        for key, router in self.routers.items():
            if key not in self._stats:
                self._stats[key] = _LayerStats(router.num_experts, self.num_bins, device, self.method == "quantile")
        keys = list(self.routers)
        for field in ("sums", "hist"):
            tensors = [getattr(self._stats[k], field) for k in keys]
            if tensors[0] is None:
                continue
            flat = torch.cat([t.to(device) for t in tensors])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            for k, chunk in zip(keys, flat.split([t.numel() for t in tensors])):
                setattr(self._stats[k], field, chunk.to(getattr(self._stats[k], field).device))
        return keys

    # -- lifetime ------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop the statistics gathered since the last `step` (no update)."""
        self._stats.clear()

    def remove(self) -> None:
        """Detach the hooks."""
        if self._handles:
            self._count_observers(-1)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stats.clear()

    def __enter__(self) -> "RouterBalancer":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


# --------------------------------------------------------------------------------------------------
# The selection biases on their own (PEFT adapters do not carry them)
# --------------------------------------------------------------------------------------------------

ROUTER_BIASES_NAME = "k3_router_biases.safetensors"
_PEFT_PREFIX = "base_model.model."


def _router_biases(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every router's selection-bias buffer, keyed by the router's name in the plain model (a PEFT wrapper's
    ``base_model.model.`` prefix dropped, so that biases move between wrapped and unwrapped models)."""
    return {name.removeprefix(_PEFT_PREFIX): module.e_score_correction_bias
            for name, module in model.named_modules() if isinstance(module, KimiK3Router)}


def save_router_biases(model: nn.Module, path) -> None:
    """Write the routers' selection biases (``e_score_correction_bias``, which Quantile Balancing trains) to a
    safetensors file. They are buffers of the base model, so a PEFT adapter saved with ``save_pretrained`` does not
    carry them: save them next to it (`QuantileBalancingCallback` does so in every checkpoint) and load them with
    `load_router_biases` after loading the adapter onto the base model. ``path`` is a file, or a directory (the
    adapter's) that gets `ROUTER_BIASES_NAME`."""
    from safetensors.torch import save_file

    biases = {name: bias.detach().float().cpu().contiguous() for name, bias in _router_biases(model).items()}
    if not biases:
        raise ValueError("the model has no K3 router (KimiK3Router): nothing to save")
    save_file(biases, str(_biases_file(path)), metadata={"format": "pt"})


def _biases_file(path) -> Path:
    """A directory (an adapter's, a checkpoint's) holds the biases under the name the callback gives them."""
    path = Path(path)
    return path / ROUTER_BIASES_NAME if path.is_dir() else path


def load_router_biases(model: nn.Module, path) -> None:
    """Copy the selection biases saved by `save_router_biases` into ``model``'s routers (all of them, by name);
    ``path`` is the file or the directory it was saved in."""
    from safetensors.torch import load_file

    path = _biases_file(path)
    saved, biases = load_file(str(path)), _router_biases(model)
    if set(saved) != set(biases):
        raise ValueError(f"{path} holds the selection biases of routers {sorted(saved)[:3]}..., the model has "
                         f"{sorted(biases)[:3]}... ({len(saved)} vs {len(biases)} routers): not this model's")
    with torch.no_grad():
        for name, bias in biases.items():
            bias.copy_(saved[name])


# --------------------------------------------------------------------------------------------------
# Trainer integration
# --------------------------------------------------------------------------------------------------


class _QuantileBalancing:
    """Runs `RouterBalancer` inside a `transformers.Trainer`: statistics from every micro-batch of an
    optimizer step (all ranks), the bias update in ``on_step_end`` (after ``optimizer.step()``, before the
    next forward), and the per-layer metrics averaged over the optimizer steps since the last log added to
    the Trainer's logs (``state.log_history`` and the callbacks that run after this one)::

        trainer = Trainer(model, args, train_dataset=..., callbacks=[QuantileBalancingCallback()])

    Reporting integrations (TensorBoard, W&B, ...) are registered before user callbacks; to have them
    receive the metrics too, put the callback first with ``QuantileBalancingCallback().attach(trainer)``.
    Arguments are those of `RouterBalancer`; ``log_per_layer=False`` keeps only the summaries over layers.
    """

    def __init__(self, method: str | None = "quantile", update_rate: float | None = None, log_per_layer: bool = True,
                 **balancer_kwargs):
        self.balancer_kwargs = dict(method=method, update_rate=update_rate, **balancer_kwargs)
        self.log_per_layer = log_per_layer
        self.balancer: RouterBalancer | None = None
        self._window: dict[str, float] = defaultdict(float)
        self._window_steps = 0

    def attach(self, trainer) -> "QuantileBalancingCallback":
        """Register with ``trainer`` in first position, so every logging callback sees the metrics."""
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.balancer is None:
            self.balancer = RouterBalancer(model, **self.balancer_kwargs)
        self.balancer.reset()  # nothing recorded before training (e.g. an initial evaluation) counts
        if state.global_step > 0:  # resumed: the biases the checkpoint saved (a PEFT resume restores only adapters)
            import os

            # (callbacks are not told which checkpoint the Trainer resumed from: the one of this step in the output
            # directory, as Trainer names them, or the one the arguments name)
            candidates = [os.path.join(args.output_dir, f"checkpoint-{state.global_step}")]
            if isinstance(args.resume_from_checkpoint, str):
                candidates.insert(0, args.resume_from_checkpoint)
            paths = [os.path.join(c, ROUTER_BIASES_NAME) for c in candidates
                     if os.path.isfile(os.path.join(c, ROUTER_BIASES_NAME))]
            if paths:
                load_router_biases(model, paths[0])
            elif any(name.startswith(_PEFT_PREFIX) for name, _ in model.named_modules()):
                warnings.warn(f"resumed at step {state.global_step} but found no {ROUTER_BIASES_NAME} in "
                              f"{candidates}: the routers' selection biases (not part of a PEFT adapter) start from "
                              "the base model's values; load_router_biases(model, path) restores them", stacklevel=2)

    def on_save(self, args, state, control, model=None, **kwargs):
        """Every checkpoint also gets the selection biases in their own file (a PEFT checkpoint holds only the
        adapters; `on_train_begin` of a resumed run reads them back)."""
        import os

        directory = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if model is not None and os.path.isdir(directory) and args.should_save:
            save_router_biases(model, os.path.join(directory, ROUTER_BIASES_NAME))

    def on_step_end(self, args, state, control, **kwargs):
        if self.balancer is None:
            return
        for name, value in self.balancer.step().items():
            self._window[name] += value
        self._window_steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self._window_steps or "loss" not in logs:
            return
        extra = {
            name: total / self._window_steps
            for name, total in self._window.items()
            if self.log_per_layer or name.count("/") == 1
        }
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)
        self._window.clear()
        self._window_steps = 0

    def on_train_end(self, args, state, control, **kwargs):
        if self.balancer is not None:
            self.balancer.remove()
            self.balancer = None


def __getattr__(name: str):
    # `QuantileBalancingCallback` is made on first use: subclassing transformers' TrainerCallback imports the Trainer's
    # modules (and with them peft and bitsandbytes), which made `import transformers_k3` (every `generate` run) take
    # seconds longer and print bitsandbytes' warnings
    if name == "QuantileBalancingCallback":
        from transformers import TrainerCallback

        callback = type("QuantileBalancingCallback", (_QuantileBalancing, TrainerCallback),
                        {"__module__": __name__, "__doc__": _QuantileBalancing.__doc__})
        globals()[name] = callback
        return callback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
