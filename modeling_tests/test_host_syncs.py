"""Host syncs per decode step (issue 30, item 8): on a GPU every op that reads a tensor's value on the host
(``bool(t)``, ``int(t)``, ``.item()``, ``.tolist()``, ``nonzero``) waits for the device queue to drain, so a decode
step that has any stalls once per sync. Counted here on CPU with the C++ kernels off (the code path CUDA tensors
take) and the device-dependent choices made as on a GPU: a sync counts as ours when the innermost non-torch frame
that asked for it is in transformers_k3 (transformers' own mask building syncs once per masked step; not ours)."""

import collections
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import transformers_k3.modeling_kimi_k3 as modeling
from transformers_k3 import KimiK3ForCausalLM, KimiK3HybridCache, KimiK3TextConfig
from transformers_k3.modeling_kimi_k3 import KimiK3DeltaAttention
from transformers_k3.ops.kda import chunk_kda, fused_recurrent_kda

from references import randomize_

# the aten ops by which a value reaches the host (``int()``, ``bool()``, ``.item()`` go through _local_scalar_dense)
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "equal", "allclose"}


def _to_host(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` (the tensor first in ``args``) names the CPU as its target (from a GPU:
    a blocking copy). Only a literal ``"cpu"`` counts: here every device is the CPU, so ``.to(other.device)`` cannot
    be told apart."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return not kwargs.get("non_blocking") and isinstance(target, str) and torch.device(target).type == "cpu"


# the Tensor methods that copy to the host: on CPU tensors they dispatch no aten op, so their torch-function calls count
HOST_COPIES = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}


class _HostCopies(TorchFunctionMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_COPIES or func is torch.Tensor.to and _to_host(args, kwargs):
            self.record()
        return func(*args, **kwargs)


class HostSyncs(TorchDispatchMode):
    """Counts host syncs by the source line (file:line) of the innermost non-torch frame that caused each: the aten
    ops that read a value, and the Tensor methods that copy to the host, which on CPU tensors dispatch nothing
    (``tolist``, ``cpu``, ``numpy``, ``to("cpu")``), seen as torch-function calls."""

    def __init__(self):
        super().__init__()
        self.where = collections.Counter()
        self._copies = _HostCopies(self._record)

    def _record(self) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename and f.filename != __file__]
        caller = frames[-1] if frames else None
        self.where[f"{caller.filename}:{caller.lineno}" if caller else "?"] += 1

    def __enter__(self):
        self._copies.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._copies.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in SYNC_OPS:
            self._record()
        return func(*args, **(kwargs or {}))

    @property
    def ours(self) -> dict:
        return {where: n for where, n in self.where.items() if "transformers_k3" in where}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny())).eval()


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """The plain model (no kernels) with the device-dependent choice made as on a GPU: host reads are not free."""
    # why: this machine has no GPU, where reading a tensor's values on the host costs a sync
    monkeypatch.setattr(modeling, "_host_reads_are_free", lambda tensor: False)
    with torch.no_grad():
        yield


@pytest.fixture
def fake_fla(model):
    """Stand-ins for fla's kernels in the KDA layers' kernel slot (what they call for CUDA tensors; no CUDA or Triton
    here): they return the right shapes without reading anything, so only our code around the kernel runs."""

    calls = []

    def chunk(q, k, v, g, beta, initial_state=None, output_final_state=False, **kwargs):
        calls.append(q.shape[1])
        state = torch.zeros(q.shape[0], v.shape[2], q.shape[3], v.shape[3])
        return torch.zeros_like(v), state if output_final_state else None

    layers = [layer for layer in model.modules() if isinstance(layer, KimiK3DeltaAttention)]
    kept = [layer.kernel for layer in layers]
    for layer in layers:
        layer.kernel = (chunk, chunk)
    yield calls
    for layer, kernel in zip(layers, kept):
        layer.kernel = kernel


PROMPT = torch.randint(3, 400, (2, 6), generator=torch.Generator().manual_seed(0))
LEFT_PADDED = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])


def manual_steps(model, rows: int, mask: torch.Tensor | None, steps: int = 3) -> list[HostSyncs]:
    """Host syncs of each decode step after a prefill, driving the model by hand."""
    cache = model(PROMPT[:rows], attention_mask=mask, use_cache=True).past_key_values
    counts, token = [], PROMPT[:rows, -1:]
    for _ in range(steps):
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(rows, 1)], 1)
        with HostSyncs() as syncs:
            token = model(token, attention_mask=mask, past_key_values=cache).logits[:, -1:].argmax(-1)
        counts.append(syncs)
    return counts


@pytest.mark.parametrize("kda_path", ["torch", "fla"])
@pytest.mark.parametrize("inputs", ["one row", "one row, mask of ones", "left-padded rows"])
def test_a_decode_step_by_hand_syncs_only_for_a_mask(model, as_on_a_gpu, request, kda_path, inputs):
    """Driven by hand, a cached step on a GPU reads nothing for its ids (the embedding's device-side bounds check
    stands) and, given a 2-D mask, reads its hole check: none for a batch of one without a mask, one with."""
    fla_calls = request.getfixturevalue("fake_fla") if kda_path == "fla" else None
    rows, mask = {"one row": (1, None), "one row, mask of ones": (1, torch.ones(1, 6, dtype=torch.long)),
                  "left-padded rows": (2, LEFT_PADDED)}[inputs]
    for syncs in manual_steps(model, rows, mask):
        assert sum(syncs.ours.values()) == (0 if mask is None else 1), syncs.ours
    assert fla_calls is None or 1 in fla_calls  # (the decode steps went through the fla wrappers)


def test_the_checks_of_a_step_by_hand_still_refuse_bad_values(model):
    """Where host reads are free (the CPU) a cached step's ids are still checked; on a GPU the prompt's are."""
    cache = model(PROMPT[:2], attention_mask=LEFT_PADDED, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        model(torch.tensor([[3], [model.config.vocab_size]]), attention_mask=torch.ones(2, 7, dtype=torch.long),
              past_key_values=cache)
    holed = torch.tensor([[1] * 7, [0, 0, 1, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match="position 3 of row 1 between attended tokens"):
        model(PROMPT[:2, :1], attention_mask=holed, past_key_values=cache)


def test_on_a_gpu_a_prompts_ids_are_still_checked(model, as_on_a_gpu):
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        model(torch.tensor([[3, model.config.vocab_size]]), past_key_values=KimiK3HybridCache(model.config))
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        model(torch.tensor([[3, -1]]))


class _CountingForward:
    """The host syncs of each call of the model (generate()'s steps), in order, through forward pre- and post-hooks
    on the model (torch's sockets for "around a module's forward")."""

    def __init__(self, model):
        self.calls = []
        self._running = []
        self._handles = [model.register_forward_pre_hook(self._enter),
                         model.register_forward_hook(self._exit, always_call=True)]

    def _enter(self, module, args):
        syncs = HostSyncs()
        syncs.__enter__()
        self._running.append(syncs)

    def _exit(self, module, args, output):
        syncs = self._running.pop()
        syncs.__exit__(None, None, None)
        self.calls.append(syncs)

    def remove(self):
        for handle in self._handles:
            handle.remove()


@pytest.mark.parametrize("kda_path", ["torch", "fla"])
@pytest.mark.parametrize("rows", [1, 2])
def test_generate_decode_steps_have_no_host_sync_in_our_code(model, as_on_a_gpu, request, rows,
                                                             kda_path):
    """generate() only appends ones to a mask whose prompt part the first step checked, and feeds back the model's
    own tokens: its decode steps need neither check, so they sync nowhere in our code, padded or not."""
    if kda_path == "fla":
        request.getfixturevalue("fake_fla")
    counting = _CountingForward(model)
    mask = LEFT_PADDED[:rows] if rows == 2 else None
    try:
        model.generate(PROMPT[:rows], attention_mask=mask, max_new_tokens=4, do_sample=False,
                       past_key_values=KimiK3HybridCache(model.config))
    finally:
        counting.remove()
    assert len(counting.calls) == 4
    for syncs in counting.calls[1:]:
        assert syncs.ours == {}


@pytest.mark.parametrize("rows", [1, 2])
def test_multimodal_generate_decode_steps_have_no_host_sync_in_our_code(as_on_a_gpu, rows):
    """The multimodal model's forward checks its ids and media slots only where the text model does: generate()'s
    own decode steps (it checked the ids every step, and read the cache's token record)."""
    from transformers_k3 import KimiK3Config, KimiK3ForConditionalGeneration

    torch.manual_seed(0)
    vl = randomize_(KimiK3ForConditionalGeneration(KimiK3Config.tiny())).eval()
    counting = _CountingForward(vl)
    mask = LEFT_PADDED[:rows] if rows == 2 else None
    try:
        vl.generate(PROMPT[:rows], attention_mask=mask, max_new_tokens=4, do_sample=False,
                    past_key_values=KimiK3HybridCache(vl.config.text_config))
    finally:
        counting.remove()
    assert len(counting.calls) == 4
    for syncs in counting.calls[1:]:
        assert syncs.ours == {}


def _reference_processed(processor, input_ids, scores):
    """The processor's rule applied row by row through `forced_token` (host reads and all)."""
    expected = scores.clone()
    for row in range(input_ids.shape[0]):
        token = processor.forced_token(input_ids[row])
        if token is not None:
            expected[row] = float("-inf")
            expected[row, token] = 0.0
    return expected


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_the_thinking_budget_processor_reads_nothing_on_the_host_and_agrees_row_by_row(budget):
    """It read 4-6 values per row per step (nonzero, int, equal); batched on the device it reads none, and forces
    what the row-by-row rule does on every kind of row (no marker, open, over budget, mid forced sequence, closed)."""
    from transformers_k3 import ThinkingBudgetLogitsProcessor

    processor = ThinkingBudgetLogitsProcessor(budget, think_open_ids=[7, 8], end_sequence_ids=[2, 9, 10, 11],
                                              stop_ids=[2, 3])
    gen = torch.Generator().manual_seed(budget)
    vocab = 12
    for length in (1, 2, 3, 6, 10):
        # small ids so that markers, stops and the forced sequence turn up often, in any order
        ids = torch.randint(0, vocab, (64, length), generator=gen)
        ids[::3, :2] = torch.tensor([7, 8])[: min(2, length)]
        if length >= 6:
            ids[1::4, -3:] = torch.tensor([2, 9, 10])
        scores = torch.randn(64, vocab, generator=gen)
        with HostSyncs() as syncs:
            out = processor(ids, scores)
        assert syncs.where == {}
        torch.testing.assert_close(out, _reference_processed(processor, ids, scores), rtol=0, atol=0)


@pytest.mark.parametrize("strong", [False, True])
def test_the_torch_chunked_kda_syncs_once_per_call(strong):
    """The PyTorch chunked path (a CUDA user without fla) checked every group of chunks' decay span on the host: one
    sync per group, about one per chunk at K3's 96 heads. A bound on the whole gate decides once; gates too strong
    for it keep the per-group check (and its result)."""
    gen = torch.Generator().manual_seed(0)
    batch, length, heads, dim = 1, 32 * 24, 8, 128  # 24 chunks in 3 groups of 8
    q, k, v = (torch.randn(batch, length, heads, dim, generator=gen) for _ in range(3))
    g = -torch.rand(batch, length, heads, dim, generator=gen) * (7.0 if strong else 4.9)
    beta = torch.rand(batch, length, heads, generator=gen)
    common = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        with HostSyncs() as syncs:
            out, state = chunk_kda(q, k, v, g, beta, **common)
        reference, reference_state = fused_recurrent_kda(q, k, v, g, beta, **common)  # the token loop
    if strong:
        assert sum(syncs.ours.values()) > 3, syncs.ours  # (the bound and each group's own checks)
    else:
        assert sum(syncs.ours.values()) == 1, syncs.ours
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, reference_state, atol=1e-4, rtol=1e-4)
