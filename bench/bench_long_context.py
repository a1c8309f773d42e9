"""Long-context decoding: K3's hybrid cache vs transformers' in-tree Kimi Linear and a same-size Llama.

One run, same weights: a small model with the K3-only features off (so `KimiLinearForCausalLM` loads the very
same weights through the in-tree key map), the ANCHORS.md shape (hidden 256, 8 layers at 3 KDA : 1 MLA, 4 heads,
MLA kv_lora 128 / rope 32 / nope 64 / v 64, 8 experts top-2, vocab 4096). For each context N it prints, per
model: cache bytes (ours also against the analytic value), the per-token decode latency (median of several
steps, timed with nothing else running) and the transient memory of a decode step (two more steps: peak RSS
during the step minus RSS before it, sampled every 0.2 ms by a thread, after returning freed memory to the OS).
Each (model, context) runs in its own process.

``--model-kind k3`` makes "ours" the model users run instead: every K3 feature on as the release config has them
(Block AttnRes in 4-layer blocks, the latent MoE with SiTU-GLU and its latent norm, a shared expert, gated NoPE
MLA, the full-rank lower-bounded KDA gate) at the same hidden size, layers, heads, MLA and expert shapes. It cannot
load into Kimi Linear, so the in-tree rows are then same-shape models with their own random weights. ``--model-kind
k3 kimi-linear`` measures both (in ``--paired`` mode in the same process; the K3 rows are named ``k3``).

Decode cost does not depend on what the context says, so the caches are filled to N tokens directly (random
latents / keys / values after an 8-token real prefill that initialises every layer) instead of prefilling N
tokens, which would take the in-tree model hours at 128K.

``--context N`` instead measures the real thing for our model alone (the shipped small model unless ``--model``):
a chunked prefill of N random tokens (``--chunk``) into a cache preallocated for N, then 32 decode steps; it prints
prefill time, the last chunk's time, per-token decode time, peak RSS and cache bytes vs analytic. The prefill is
quadratic in the MLA layers, so at a million tokens it takes hours on a laptop CPU; ``--synthetic-prefix S`` puts
S synthetic latent rows in front instead of prefilling them, so the real chunks after them and the decode steps
run at the full depth N.

    python bench/bench_long_context.py                       # 4K, 32K, 128K
    python bench/bench_long_context.py --contexts 4096 16384 # quicker
    python bench/bench_long_context.py --context 262144      # million-token mode (our model only)
    python bench/bench_long_context.py --contexts 16384 --paired 15   # eager/compiled/in-tree in one process
    python bench/bench_long_context.py --contexts 16384 --paired 15 --model-kind k3 kimi-linear   # both models
    python bench/bench_long_context.py --context 1048576 --synthetic-prefix 1040384   # decode at 1M
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

import torch

HIDDEN, LAYERS, HEADS, VOCAB = 256, 8, 4, 4096
THREADS = int(os.environ.get("BENCH_THREADS", "2"))  # (--threads: the children read it)


def kimi_linear_config():
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    full = [i for i in range(1, LAYERS + 1) if i % 4 == 0]
    return KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
        routed_scaling_factor=2.5, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32, v_head_dim=64,
        qk_nope_head_dim=64, n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True,
        hidden_act="silu", rms_norm_eps=1e-5, num_local_experts=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, first_k_dense_replace=1,
        linear_attn_config={"kda_layers": [i for i in range(1, LAYERS + 1) if i not in full],
                            "full_attn_layers": full, "num_heads": HEADS, "head_dim": 64,
                            "short_conv_kernel_size": 4},
    )


# The K3-featured bench model (--model-kind k3): kimi_linear_config()'s shapes with the release's K3 features on.
# q_lora_rank stays None as in the Kimi-Linear-shaped model (a DeepSeek MLA option, not a K3 feature), so the
# projections match the comparison rows; routed experts run at half the hidden width, as in the release.
K3_FEATURES = dict(
    hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0, mla_use_nope=True,
    mla_use_output_gate=True, num_shared_experts=1, routed_expert_hidden_size=HIDDEN // 2, latent_moe_use_norm=True,
    routed_scaling_factor=1.0, attn_res_block_size=4,
)
K3_LINEAR_ATTN = {"use_full_rank_gate": True, "gate_lower_bound": -5.0}
MODEL_KINDS = ("kimi-linear", "k3")


def k3_config_dict() -> dict:
    """Keyword arguments of `KimiK3TextConfig` for the K3-featured bench model: kimi_linear_config()'s shapes as
    `conversion.kimi_linear_config_to_k3` maps them, plus K3_FEATURES (plain values, so any tree can read them)."""
    full = [i for i in range(1, LAYERS + 1) if i % 4 == 0]
    return dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, num_experts=8, num_experts_per_token=2, moe_intermediate_size=256,
        first_k_dense_replace=1, moe_layer_freq=1, moe_router_activation_func="sigmoid", moe_renormalize=True,
        topk_method="noaux_tc", num_expert_group=1, topk_group=1,
        linear_attn_config={"kda_layers": [i for i in range(1, LAYERS + 1) if i not in full],
                            "full_attn_layers": full, "num_heads": HEADS, "head_dim": 64,
                            "short_conv_kernel_size": 4, **K3_LINEAR_ATTN},
        **K3_FEATURES,
    )


def build(kind: str, model_kind: str = "kimi-linear"):
    """The model of `kind` with the shared seeded weights (``model_kind="k3"``: ours is the K3-featured model, with
    its own seeded weights); ours with the fused CPU kernels attached (`kernelize`, as the README says)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

    torch.manual_seed(0)
    if kind == "ours" and model_kind == "k3":
        from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig

        config = KimiK3TextConfig(**k3_config_dict())
        config._attn_implementation = "sdpa"
        return kernelized(KimiK3ForCausalLM(config).eval())
    kl_config = kimi_linear_config()
    kl_config._attn_implementation = "sdpa"
    reference = KimiLinearForCausalLM(kl_config).eval()
    if kind == "intree":
        return reference
    if kind == "qwen3next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, moe_intermediate_size=256,
            shared_expert_intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=HEADS, head_dim=64, linear_num_key_heads=HEADS, linear_num_value_heads=HEADS,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
            layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(LAYERS)],
        )  # fmt: skip
        config._attn_implementation = "sdpa"
        return Qwen3NextForCausalLM(config).eval()
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=64)
        config._attn_implementation = "sdpa"
        return LlamaForCausalLM(config).eval()
    from transformers_k3 import KimiK3ForCausalLM
    from transformers_k3.conversion import kimi_linear_to_k3_state_dict
    from transformers_k3.convert.kimi_linear import kimi_linear_config_to_k3

    config = kimi_linear_config_to_k3(kl_config)
    config._attn_implementation = "sdpa"
    model = KimiK3ForCausalLM(config).eval()
    model.load_state_dict(kimi_linear_to_k3_state_dict(reference.state_dict(), HEADS), strict=True)
    return kernelized(model)


def kernelized(model, enabled: bool = True):
    """``model`` with the fused CPU kernels attached (or, ``enabled=False``, detached) the way the README says; a
    tree from before `kernelize` (the issue 45 baseline) has them on by default, so this script measures both."""
    import transformers_k3

    kernelize = getattr(transformers_k3, "kernelize", None)
    return model if kernelize is None else kernelize(model, enabled)


def fill_cache(kind: str, model, n: int):
    """Prefill 8 real tokens (initialises every layer), then give every full-attention layer N cached tokens."""
    from transformers import DynamicCache

    ids = torch.randint(3, VOCAB, (1, 8))
    if kind == "ours":
        from transformers_k3 import KimiK3HybridCache

        cache = KimiK3HybridCache(model.config)
    else:
        cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        if kind == "ours" and hasattr(layer, "latent"):
            layer.latent = torch.randn(1, n, layer.latent.shape[-1]) * 0.5
            layer.length = n
        elif getattr(layer, "keys", None) is not None and layer.keys.dim() == 4:
            layer.keys = torch.randn(*layer.keys.shape[:2], n, layer.keys.shape[-1]) * 0.5
            layer.values = torch.randn(*layer.values.shape[:2], n, layer.values.shape[-1]) * 0.5
    return cache


def cache_bytes(kind: str, cache) -> int:
    if kind == "ours":
        return cache.nbytes()
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.nbytes
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            total += sum(t.nbytes for t in states.values() if isinstance(t, torch.Tensor))
    return total


def analytic_cache_bytes(config, n: int) -> int:
    kda = config.layer_types.count("linear_attention")
    mla = config.layer_types.count("full_attention")
    proj = config.linear_num_heads * config.linear_head_dim
    per_kda = 3 * proj * (config.linear_conv_kernel_size - 1) * 4 + config.linear_num_heads * config.linear_head_dim ** 2 * 4
    return mla * n * (config.kv_lora_rank + config.qk_rope_head_dim) * 4 + kda * per_kda


class RssSampler:
    """Peak resident set size while a block runs, sampled from /proc/self/statm."""

    def __init__(self, period: float = 2e-4):
        self.period, self.peak, self._stop = period, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.period)

    def __enter__(self):
        self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def release_free_memory():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


# Our model's modes: eager or torch.compile (inductor, fullgraph, dynamic shapes), the fused CPU kernels on or off.
OUR_MODES = {"ours": (False, True), "ours-nokern": (False, False), "ours-compiled": (True, True),
             "ours-compiled-nokern": (True, False)}


def child_decode(kind: str, n: int, steps: int, model_kind: str = "kimi-linear") -> dict:
    torch.set_num_threads(THREADS)
    compiled, kernels = OUR_MODES.get(kind, (False, True))
    if kind in OUR_MODES:
        from transformers_k3.ops import cpu_kernel

        if hasattr(cpu_kernel, "set_enabled"):  # (a tree from before kernelize: its process-wide switch)
            cpu_kernel.set_enabled(kernels)
        kind = "ours"
    model = build(kind, model_kind)
    if kind == "ours" and not kernels:
        model = kernelized(model, False)
    cache = fill_cache(kind, model, n)
    token = torch.tensor([[7]])
    times, transients = [], []
    step = torch.compile(model, fullgraph=True, dynamic=True) if compiled else model
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(2 if compiled else 1):  # warm-up (compiled: the first step traces, the second too (the
            step(token, past_key_values=cache, use_cache=True)  # cache length becomes dynamic))
        warmup_s = time.perf_counter() - start
        model = step
        for _ in range(steps):  # timed with nothing else running (the sampler's thread takes a core and the GIL)
            start = time.perf_counter()
            model(token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
        for _ in range(2):  # then the memory of a step, sampled
            release_free_memory()
            with RssSampler() as sampler:
                before = sampler.rss()
                model(token, past_key_values=cache, use_cache=True)
            transients.append(sampler.peak - before)
    result = {"decode_ms": 1e3 * statistics.median(times), "transient_mb": max(transients) / 2**20,
              "cache_mb": cache_bytes(kind, cache) / 2**20, "warmup_s": warmup_s}
    if kind == "ours":
        result["analytic_mb"] = analytic_cache_bytes(model.config, cache.get_seq_length()) / 2**20
    return result


def _ours_name(model_kind: str) -> str:
    return "k3" if model_kind == "k3" else "ours"


def child_paired(n: int, rounds: int, model_kinds: list[str]) -> dict:
    """Ours eager and ours compiled (kernels on; the same model and cache) for each of ``model_kinds`` (named
    ``ours`` for the Kimi-Linear-shaped model, ``k3`` for the K3-featured one), in-tree Kimi Linear and Qwen3-Next,
    all in this process at context ``n``, one decode step of each per round: per-model medians and, per pair, the
    median over rounds of the one step / the other (the host's drift cancels within a round)."""
    torch.set_num_threads(THREADS)
    models = {}
    for model_kind in model_kinds:
        ours = build("ours", model_kind)
        cache = fill_cache("ours", ours, n)
        name = _ours_name(model_kind)
        models[name] = (ours, cache)
        models[f"{name}-compiled"] = (torch.compile(ours, fullgraph=True, dynamic=True), cache)
    for kind in ("intree", "qwen3next"):
        model = build(kind)
        models[kind] = (model, fill_cache(kind, model, n))
    token = torch.tensor([[7]])
    times: dict[str, list[float]] = {kind: [] for kind in models}
    with torch.no_grad():
        for model, cache in models.values():  # warm-up (the compiled model traces twice: the length turns dynamic)
            for _ in range(2):
                model(token, past_key_values=cache, use_cache=True)
        for _ in range(rounds):
            for kind, (model, cache) in models.items():
                start = time.perf_counter()
                model(token, past_key_values=cache, use_cache=True)
                times[kind].append(time.perf_counter() - start)
    result = {"ms": {kind: 1e3 * statistics.median(t) for kind, t in times.items()}, "ratios": {}}
    for model_kind in model_kinds:
        name = _ours_name(model_kind)
        for mine in (f"{name}-compiled", name):
            for other in ((name, "intree", "qwen3next") if mine != name else ("intree", "qwen3next")):
                result["ratios"][f"{other} / {mine}"] = statistics.median(
                    a / b for a, b in zip(times[other], times[mine]))
    return result


def child_context(n: int, chunk: int, decode_steps: int, model_dir: str | None, synthetic: int = 0) -> dict:
    from transformers import AutoModelForCausalLM

    from transformers_k3 import KimiK3HybridCache

    torch.set_num_threads(THREADS)
    if model_dir == "bench":
        model = build("ours")
    else:
        from transformers_k3.small import SMALL_DIR

        # The text part of a saved K3 (the shipped small model by default): AutoModelForCausalLM on a composite
        # checkpoint loads the language model alone.
        model = kernelized(AutoModelForCausalLM.from_pretrained(model_dir or SMALL_DIR).eval())
    # Preallocated for the whole run: the latent buffers are reserved once and never regrown.
    cache = KimiK3HybridCache(model.config, max_cache_len=n + decode_steps, batch_size=1)
    if synthetic:
        # The first `synthetic` context tokens are not run: each MLA layer gets latent rows at the scale of real
        # (RMS-normed) ones. What follows is real: it attends to all of them and the decode cost is that of depth n.
        gen = torch.Generator().manual_seed(0)
        for layer in cache.layers:
            if hasattr(layer, "latent"):
                for begin in range(0, synthetic, 65536):
                    end = min(begin + 65536, synthetic)
                    layer.latent[:, begin:end] = torch.randn(1, end - begin, layer.latent.shape[-1], generator=gen)
                layer.length = synthetic
    ids = torch.randint(3, model.config.vocab_size, (1, n - synthetic))
    chunk_times = []
    start = time.perf_counter()
    last_report = start
    with torch.no_grad():
        for begin in range(0, n - synthetic, chunk):
            t0 = time.perf_counter()
            logits = model(ids[:, begin:begin + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            chunk_times.append(time.perf_counter() - t0)
            if time.perf_counter() - last_report > 30:
                last_report = time.perf_counter()
                print(f"  prefilled {synthetic + begin + chunk:,}/{n:,} tokens, {last_report - start:.0f} s",
                      file=sys.stderr, flush=True)
        prefill_s = time.perf_counter() - start
        token = logits[:, -1:].argmax(-1)
        times = []
        for _ in range(decode_steps):
            t0 = time.perf_counter()
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
    return {"context": n, "synthetic": synthetic, "prefill_s": prefill_s, "last_chunk_s": chunk_times[-1],
            "chunk": chunk, "decode_ms": 1e3 * statistics.median(times),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "cache_mb": cache.nbytes() / 2**20, "analytic_mb": analytic_cache_bytes(model.config, n + decode_steps) / 2**20}


def run_child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=["ours", "intree", "llama"],
                        help="of ours, ours-nokern, ours-compiled, ours-compiled-nokern (torch.compile, the CPU "
                             "kernels on / off), intree (Kimi Linear), qwen3next, llama")
    parser.add_argument("--context", type=int, help="million-token mode: real chunked prefill + 32 decode steps")
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--synthetic-prefix", type=int, default=0,
                        help="with --context: this many leading context tokens are synthetic latent rows instead of "
                             "a real prefill (decode figures at a depth whose real prefill takes hours)")
    parser.add_argument("--model", help="a saved K3 directory for --context (default: the shipped small model; "
                                        "'bench' for the decode table's model)")
    parser.add_argument("--paired", type=int, metavar="ROUNDS",
                        help="instead: ours eager and compiled, in-tree Kimi Linear and Qwen3-Next in one process per "
                             "context, one step of each per round, ROUNDS rounds (ratios per round)")
    parser.add_argument("--model-kind", nargs="+", choices=MODEL_KINDS, default=["kimi-linear"],
                        help="which model 'ours' is: kimi-linear (K3 features off, the in-tree model loads its "
                             "weights) and/or k3 (every K3 feature on, as the release config has them)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads in each measuring process (on a machine shared with other work, 1, or "
                             "OMP_WAIT_POLICY=PASSIVE, keeps a parallel region from spinning on a descheduled thread)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.child:  # (the children read it at import)
        os.environ["BENCH_THREADS"] = str(args.threads)

    if args.child == "paired":
        print(json.dumps(child_paired(args.n, args.steps, args.model_kind)))
        return
    if args.paired:
        print(f"torch {torch.__version__}, {args.threads} threads; {args.paired} rounds of one decode step per model, "
              f"one process; ours: {', '.join(args.model_kind)}")
        for n in args.contexts:
            r = run_child(["--child", "paired", "--n", str(n), "--steps", str(args.paired),
                           "--model-kind", *args.model_kind])
            if "error" in r:
                print(f"{n:>8}  failed: {r['error']}")
                continue
            medians = ", ".join(f"{k} {v:.1f}" for k, v in r["ms"].items())
            print(f"{n:>8}  decode ms (median): {medians}", flush=True)
            for k, v in r["ratios"].items():
                print(f"{n:>8}  median per-round ratio {k}: {v:.2f}x", flush=True)
        return
    if args.child == "context":
        print(json.dumps(child_context(args.n, args.chunk, 32, args.model, args.synthetic_prefix)))
        return
    if args.child:
        print(json.dumps(child_decode(args.child, args.n, args.steps, args.model_kind[0])))
        return
    if args.context:
        extra = ["--model", args.model] if args.model else []
        if not 0 <= args.synthetic_prefix < args.context:
            parser.error("--synthetic-prefix must be >= 0 and smaller than --context")
        r = run_child(["--child", "context", "--n", str(args.context), "--chunk", str(args.chunk),
                       "--synthetic-prefix", str(args.synthetic_prefix), *extra])
        if "error" in r:
            print("failed:", r["error"])
            return
        real = r["context"] - r["synthetic"]
        what = (f"prefill {r['prefill_s']:.1f} s ({real / r['prefill_s']:.0f} tok/s)" if not r["synthetic"] else
                f"{r['synthetic']:,} synthetic + {real:,} real tokens: real prefill {r['prefill_s']:.1f} s")
        print(f"context {r['context']:,}: {what}, last {r['chunk']}-token chunk {r['last_chunk_s']:.1f} s, "
              f"decode {r['decode_ms']:.1f} ms/token, peak RSS {r['peak_rss_mb']:.0f} MiB, "
              f"cache {r['cache_mb']:.2f} MiB (analytic {r['analytic_mb']:.2f} MiB)")
        return

    print(f"torch {torch.__version__}, {args.threads} threads; decode = median of {args.steps} steps")
    header = (f"{'context':>8} {'model':>20} {'cache MiB':>10} {'analytic':>9} {'decode ms':>10} "
              f"{'step transient MiB':>19} {'warm-up s':>10}")
    for model_kind in args.model_kind:
        print(f"ours: {model_kind}")
        print(header)
        table(args, model_kind)


def table(args, model_kind: str) -> None:
    """One process per (model, context): the rows and ratios of the decode table."""
    for n in args.contexts:
        rows = {}
        for kind in args.models:
            rows[kind] = r = run_child(["--child", kind, "--n", str(n), "--steps", str(args.steps),
                                        "--model-kind", model_kind])
            if "error" in r:
                print(f"{n:>8} {kind:>20}  failed: {r['error']}")
                continue
            analytic = f"{r['analytic_mb']:.2f}" if "analytic_mb" in r else "-"
            print(f"{n:>8} {kind:>20} {r['cache_mb']:>10.2f} {analytic:>9} {r['decode_ms']:>10.1f} "
                  f"{r['transient_mb']:>19.1f} {r['warmup_s']:>10.1f}", flush=True)
        for mine in (m for m in OUR_MODES if "decode_ms" in rows.get(m, {})):
            ratios = [f"{other} / {mine}: {rows[other]['decode_ms'] / rows[mine]['decode_ms']:.1f}x"
                      for other in ("intree", "qwen3next") if "decode_ms" in rows.get(other, {})]
            if ratios and mine != "ours":
                print(f"{n:>8}  decode {', '.join(ratios)}")
        ours, intree = rows.get("ours", {}), rows.get("intree", {})
        if "decode_ms" in ours and "decode_ms" in intree:
            print(f"{n:>8}  in-tree / ours: decode {intree['decode_ms'] / ours['decode_ms']:.1f}x, step transient "
                  f"{intree['transient_mb'] / max(ours['transient_mb'], 1e-3):.1f}x, cache "
                  f"{intree['cache_mb'] / ours['cache_mb']:.2f}x")


if __name__ == "__main__":
    main()
