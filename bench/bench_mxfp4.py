"""Packed MXFP4 routed experts (issue 46, `transformers_k3.ops.mxfp4`) against bf16 and fp32 experts, at K3's
routing scale (896 experts, top-16) on a width where the experts dominate the bytes a token reads.

    python bench/bench_mxfp4.py                          # latent 512, intermediate 512, 256-token prefill
    python bench/bench_mxfp4.py --latent 1024 --prefill-tokens 512 --decode-calls 50
    python bench/bench_mxfp4.py --tables model                # the bench model's decode step alone

One latent K3 MoE layer (`KimiK3SparseMoE`: hidden 2 x latent, router, latent projections with norm, one shared
expert at full width) built in fp32 with random weights, its routed experts quantized with the release's rule
(`quantize_mxfp4_release`) and written back dequantized, so the three rows compute the same function:

* ``packed``: the experts kept as MXFP4 stacks (``gate_up_packed [E, 2I, D/2]`` ...) under the experts-interface
  function `mxfp4_experts_forward`, registered here as ``"k3_mxfp4"`` (the layer's other modules in bf16);
* ``bf16`` / ``fp32``: the layer cast to that dtype, its experts under ``"k3_grouped_mm"`` (the fused CPU kernel
  where it takes them, else the PyTorch grouped path).

Two tables: the routed experts alone (the same routing for every row) and the whole layer; each a decode step (one
token; median of ``--decode-calls`` calls) and a prefill (``--prefill-tokens`` tokens; best of ``--reps``), no
grad. "expert MB/token" is what the experts read per token (decode: the ``k`` routed experts' weights and scales;
prefill: every expert hit at least once, divided by the tokens); "GB/s" that over the time, the distance from
the memory roofline (the copy rate of this machine, measured first, is printed beside it).

A third table, ``model``: a decode step of a small K3 bench model built that way (`bench_long_context.k3_config_dict`:
KDA + gated NoPE MLA, Block AttnRes, the latent MoE with SiTU-GLU, its norm and a shared expert, hidden 256, vocab
4096), ``--model-layers`` layers (the first dense) with the same 896 experts / top-16 and ``--model-intermediate``
wide experts, so the routed experts are most of the bytes a bf16 token reads. Built once in fp32 with seeded
weights, every layer's experts quantized with the release's rule and written back dequantized; ``bf16`` is that
model cast, ``packed`` the bf16 model with each `KimiK3Experts` replaced by a `KimiK3PackedExperts` holding the
packed stacks (what the quantizer's load builds) under ``"k3_mxfp4"``; all three with the fused CPU kernels attached
(`transformers_k3.kernelize`, as the README says). A greedy decode after a ``--prompt-tokens`` prefill: the median
of ``--decode-calls`` steps; "MB/token" is every weight the step reads (all non-expert weights, one embedding row,
and the ``k`` routed experts of every MoE layer).

A fourth table, ``stream``: that bench model exported in the release's layout (`export_release`, MXFP4
experts), loaded packed (in RAM) and with ``KimiK3Mxfp4Config(stream_experts=True)`` (the experts read
from the files each step, docs/mxfp4.md "Streaming the experts from disk"), kernelized: the decode step with the
shards in the page cache, and with their pages dropped before every step (``posix_fadvise(DONTNEED)`` on the
shards only: each step reads its experts from the disk); "expert MB/token read" is the stream's own counter, and
the logits are compared with the packed model's (the same bytes: they are equal)."""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time

import torch


# The timings' clock: wall time, or (``--clock thread``) the time the calling thread computed, which other
# processes on a shared machine do not move (one thread: all of a step's work is on it).
CLOCK = [time.perf_counter]


def copy_rate(megabytes: int = 512) -> float:
    """This machine's memory copy rate (GB/s read + written), best of five."""
    src = torch.empty(megabytes << 18, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def quantize_experts(experts, chunk: int = 64):
    """The experts' packed stacks (release rule), and their weights replaced by the dequantized values."""
    from transformers_k3.conversion.quant import quantize_mxfp4_release
    from transformers_k3.ops.mxfp4_torch import dequantize

    stacks = []
    for param in (experts.gate_up_proj, experts.down_proj):
        e, n, k = param.shape
        packed = torch.empty(e, n, k // 2, dtype=torch.uint8)
        scale = torch.empty(e, n, k // 32, dtype=torch.uint8)
        with torch.no_grad():
            for i in range(0, e, chunk):
                block = param[i : i + chunk]
                p, s = quantize_mxfp4_release(block.reshape(-1, k))
                packed[i : i + chunk] = p.view(-1, n, k // 2)
                scale[i : i + chunk] = s.view(-1, n, k // 32)
                block.copy_(dequantize(packed[i : i + chunk], scale[i : i + chunk]))
        stacks += [packed, scale]
    return stacks


def build(args):
    from transformers_k3 import KimiK3TextConfig
    from transformers_k3.modeling_kimi_k3 import K3_GROUPED_MM, KimiK3SparseMoE
    from transformers_k3.ops.mxfp4 import MXFP4_EXPERTS

    E, k, D, I = args.experts, args.top_k, args.latent, args.intermediate
    config = KimiK3TextConfig.tiny(hidden_size=2 * D, num_experts=E, num_experts_per_token=k,
                                   moe_intermediate_size=I, routed_expert_hidden_size=D, num_shared_experts=1)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    fp32 = KimiK3SparseMoE(copy.deepcopy(config))
    with torch.no_grad():
        for name, p in fp32.named_parameters():
            p.copy_(torch.ones(()) if "norm" in name else torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    stacks = quantize_experts(fp32.experts)
    fp32.experts.config._experts_implementation = K3_GROUPED_MM

    shared = {name: t for name, t in fp32.state_dict().items() if not name.startswith("experts.")}
    with torch.device("meta"):
        bf16 = KimiK3SparseMoE(copy.deepcopy(config))
        packed = KimiK3SparseMoE(copy.deepcopy(config))
    bf16.load_state_dict(fp32.state_dict(), assign=True)
    bf16.to(torch.bfloat16)  # (copies: the fp32 layer keeps its tensors)
    bf16.experts.config._experts_implementation = K3_GROUPED_MM
    packed.load_state_dict(shared, strict=False, assign=True)
    del packed.experts.gate_up_proj, packed.experts.down_proj
    packed.to(torch.bfloat16)
    for name, t in zip(("gate_up_packed", "gate_up_scale", "down_packed", "down_scale"), stacks):
        packed.experts.register_buffer(name, t)
    packed.experts.config._experts_implementation = MXFP4_EXPERTS
    for layer in (fp32, bf16, packed):
        bad = [name for name, t in (*layer.named_parameters(), *layer.named_buffers()) if t.is_meta]
        assert not bad, bad
    return {"packed": packed, "bf16": bf16, "fp32": fp32}


def expert_bytes(experts) -> int:
    """Bytes of one expert's weights (and scales) as an experts module stores them."""
    names = ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale") if hasattr(experts, "gate_up_packed") \
        else ("gate_up_proj", "down_proj")  # fmt: skip
    return sum(getattr(experts, n)[0].numel() * getattr(experts, n).element_size() for n in names)


def model_config(args):
    """The K3-featured bench model's config (bench_long_context) at ``--model-layers`` layers (every fourth MLA, the
    first dense) with ``--experts`` / ``--top-k`` routed experts ``--model-intermediate`` wide."""
    from bench_long_context import k3_config_dict

    from transformers_k3 import KimiK3TextConfig

    layers = args.model_layers
    full = [i for i in range(1, layers + 1) if i % 4 == 0]
    values = k3_config_dict()
    values.update(num_hidden_layers=layers, num_experts=args.experts, num_experts_per_token=args.top_k,
                  moe_intermediate_size=args.model_intermediate)  # fmt: skip
    values["linear_attn_config"] = {**values["linear_attn_config"], "full_attn_layers": full,
                                    "kda_layers": [i for i in range(1, layers + 1) if i not in full]}  # fmt: skip
    config = KimiK3TextConfig(**values)
    config._attn_implementation = "sdpa"
    return config


def build_models(args):
    """The bench model in fp32 (experts quantized, dequantized back), bf16 and packed, each kernelized."""
    from bench_long_context import kernelized

    from transformers_k3 import KimiK3ForCausalLM
    from transformers_k3.modeling_kimi_k3 import KimiK3Experts
    from transformers_k3.ops.mxfp4 import MXFP4_EXPERTS
    from transformers_k3.quantization_kimi_k3 import KimiK3PackedExperts

    torch.manual_seed(0)
    fp32 = KimiK3ForCausalLM(model_config(args)).eval()
    stacks = {name: quantize_experts(m) for name, m in fp32.named_modules() if isinstance(m, KimiK3Experts)}
    bf16 = cast_copy(fp32, torch.bfloat16, drop=())
    packed = cast_copy(fp32, torch.bfloat16, drop=tuple(f"{name}." for name in stacks))
    for name, (gate_up, gate_up_scale, down, down_scale) in stacks.items():
        parent, _, child = name.rpartition(".")
        with torch.device("meta"):
            experts = KimiK3PackedExperts(packed.get_submodule(name).config)
        for stack, t in (("gate_up_packed", gate_up), ("gate_up_scale", gate_up_scale), ("down_packed", down),
                         ("down_scale", down_scale)):  # fmt: skip
            setattr(experts, stack, torch.nn.Parameter(t, requires_grad=False))
        setattr(packed.get_submodule(parent), child, experts)
    packed.set_experts_implementation(MXFP4_EXPERTS)
    models = {"packed": packed, "bf16": bf16, "fp32": fp32}
    for model in models.values():
        bad = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        assert not bad, bad
    for model in models.values():
        kernelized(model)
    return models, len(stacks)


def packed_error(models, prompt) -> float:
    """The largest difference (relative) between the packed and the bf16 model's logits on ``prompt``, both run in
    fp32 (the same weights); after the timing, as it leaves them in fp32."""
    with torch.no_grad():
        reference = models["bf16"].float()(input_ids=prompt).logits
        error = (models["packed"].float()(input_ids=prompt).logits - reference).abs().max() / reference.abs().max()
    return error.item()


def cast_copy(model, dtype: torch.dtype, drop: tuple[str, ...]):
    """A copy of ``model`` in ``dtype``, each parameter cast once (no full-precision copy of the model first); the
    parameters named under a ``drop`` prefix left on the meta device."""
    from torch import nn

    memo = {}
    for name, p in model.named_parameters():
        value = torch.empty(p.shape, device="meta") if name.startswith(drop) else p.detach().to(dtype)
        memo[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo).to(dtype)


def model_bytes(model, top_k: int) -> tuple[int, int]:
    """(non-expert, routed-expert) bytes a decode step reads: every weight but the routed experts and the embedding
    table, one embedding row, and ``top_k`` experts of every MoE layer."""
    from transformers_k3.modeling_kimi_k3 import KimiK3Experts
    from transformers_k3.quantization_kimi_k3 import KimiK3PackedExperts

    kinds = (KimiK3Experts, KimiK3PackedExperts)
    routed = [m for m in model.modules() if isinstance(m, kinds)]
    skip = {id(t) for m in routed for t in (*m.parameters(), *m.buffers())}
    embed = model.get_input_embeddings().weight
    skip.add(id(embed))
    other = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    other += embed[0].numel() * embed.element_size()
    return other, sum(top_k * expert_bytes(m) for m in routed)


def decode_step_time(model, prompt, steps: int) -> tuple[float, torch.Tensor]:
    """Median seconds of a greedy decode step after prefilling ``prompt`` (one untimed step first), and the
    prefill's last logits (fp32)."""
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1].float()
        token, times = logits.argmax().view(1, 1), []
        for i in range(steps + 1):
            start = CLOCK[0]()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            if i:
                times.append(CLOCK[0]() - start)
    return statistics.median(times), logits


def model_table(args, rate: float) -> None:
    config = model_config(args)
    prompt = torch.randint(3, config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(2))
    models, moe_layers = build_models(args)
    print(f"\n## model: decode step of the K3 bench model ({config.num_hidden_layers} layers, {moe_layers} MoE, "
          f"hidden {config.hidden_size}, E={args.experts} k={args.top_k} latent {config.routed_expert_hidden_size} "
          f"I={config.moe_intermediate_size}; prompt {args.prompt_tokens} tokens, median of {args.decode_calls} steps)")
    print("| row | ms/token | tokens/s | non-expert MB/token | expert MB/token | MB/token | GB/s | of copy rate | "
          "vs bf16 | logits vs fp32 |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = args.rows.split(",")
    timed = {name: decode_step_time(models[name], prompt, args.decode_calls) for name in dict.fromkeys([*rows, "fp32"])}
    reference = timed["fp32"][1]  # (fp32 always runs: the logits the others' are compared with)
    results = {}
    for name in rows:
        seconds, logits = timed[name]
        other, routed = model_bytes(models[name], args.top_k)
        results[name] = seconds
        ratio = results["bf16"] / seconds if "bf16" in results else float("nan")
        error = ((logits - reference).abs().max() / reference.abs().max()).item()
        total = other + routed
        print(f"| {name} | {seconds * 1e3:.2f} | {1 / seconds:,.0f} | {other / 1e6:.3f} | {routed / 1e6:.3f} | "
              f"{total / 1e6:.2f} | {total / seconds / 1e9:.2f} | {total / seconds / 1e9 / rate:.0%} | {ratio:.2f}x | "
              f"{error:.1e} |", flush=True)  # fmt: skip
    if "bf16" in results and "packed" in results:
        print(f"|  packed vs bf16 | | | | | | | | {results['bf16'] / results['packed']:.2f}x | |")
    print(f"packed vs bf16 model, both run in fp32 (the same weights), prefill logits: "
          f"{packed_error(models, prompt):.1e} (relative)")


def stream_table(args) -> None:
    import tempfile

    from bench_long_context import kernelized

    from transformers_k3 import KimiK3ForCausalLM, KimiK3Mxfp4Config, expert_stream, export_release

    config = model_config(args)
    prompt = torch.randint(3, config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(2))
    models, moe_layers = build_models(args)
    with tempfile.TemporaryDirectory(prefix="k3-stream-", dir=args.stream_dir) as parent:
        directory = os.path.join(parent, "release")
        export_release(models["fp32"], directory, dtype="bf16", mxfp4=True)  # (the experts' bytes: the same codes)
        del models
        shards = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        for name in shards:
            with open(os.path.join(directory, name), "rb+") as f:
                os.fsync(f.fileno())  # (written pages must be clean for the page cache to drop them)
        quantization = KimiK3Mxfp4Config(stream_experts=True, stream_experts_per_read=args.top_k)
        packed = kernelized(KimiK3ForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval())
        streamed = kernelized(KimiK3ForCausalLM.from_pretrained(directory, dtype=torch.bfloat16,
                                                                quantization_config=quantization).eval())
        stream = expert_stream(streamed)
        total = sum(os.path.getsize(os.path.join(directory, f)) for f in shards)

        def drop_pages():
            for name in shards:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

        print(f"\n## stream: decode step of the K3 bench model ({config.num_hidden_layers} layers, {moe_layers} MoE, "
              f"E={args.experts} k={args.top_k} I={config.moe_intermediate_size}), experts streamed from a release-"
              f"layout export ({total / 1e6:.0f} MB of shards, {stream.checkpoint_expert_bytes / 1e6:.0f} MB of "
              f"experts, staging {args.top_k} experts), prompt {args.prompt_tokens} tokens, median of "
              f"{args.decode_calls} steps")  # fmt: skip
        print("| row | ms/token | tokens/s | expert MB/token read | expert GB/s | vs packed in RAM | logits vs packed |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        base, reference = decode_step_time(packed, prompt, args.decode_calls)
        print(f"| packed in RAM | {base * 1e3:.2f} | {1 / base:,.0f} | | | 1.00x | |", flush=True)
        for row, before in (("streamed, page cache", None), ("streamed, from disk", drop_pages)):
            with torch.no_grad():
                out = streamed(input_ids=prompt, use_cache=True)
                cache, logits = out.past_key_values, out.logits[0, -1].float()
                token, times = logits.argmax().view(1, 1), []
                for i in range(args.decode_calls + 1):
                    if before is not None:
                        before()
                    if i == 1:
                        stream.reset()
                    start = time.perf_counter()
                    out = streamed(input_ids=token, past_key_values=cache, use_cache=True)
                    token = out.logits[:, -1:].argmax(-1)
                    if i:
                        times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            error = ((logits - reference).abs().max() / reference.abs().max()).item()
            print(f"| {row} | {seconds * 1e3:.2f} | {1 / seconds:,.1f} | {stream.bytes_per_token / 1e6:.2f} | "
                  f"{stream.bytes_per_token / seconds / 1e9:.2f} | {base / seconds:.2f}x | {error:.1e} |", flush=True)
        stream.close()


def timed_median(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = CLOCK[0]()
        fn()
        times.append(CLOCK[0]() - start)
    return statistics.median(times)


def timed_best(fn, reps: int) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        start = CLOCK[0]()
        fn()
        best = min(best, CLOCK[0]() - start)
    return best


def add_layer_arguments(parser: argparse.ArgumentParser) -> None:
    """The MoE layer's shape, as `build` reads it (bench_mxfp4_lora builds its layers here too)."""
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--latent", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=512)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_layer_arguments(parser)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--decode-calls", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="bf16,packed,fp32", help="which of bf16, packed, fp32 to run (bf16 first: the ratios)")
    parser.add_argument("--tables", default="experts,layer,model", help="which of experts, layer, model, stream to run")
    parser.add_argument("--model-layers", type=int, default=4, help="the bench model's layers (the first dense)")
    parser.add_argument("--model-intermediate", type=int, default=1024, help="the bench model's expert width")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="the bench model's prefill before decoding")
    parser.add_argument("--stream-dir", default=None, help="where the stream table writes its export (default: tmp)")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="time the steps by wall clock or by this thread's CPU time (with --threads 1)")
    args = parser.parse_args()
    tables = args.tables.split(",")
    if not set(tables) <= {"experts", "layer", "model", "stream"}:
        parser.error(f"--tables: choose among experts, layer, model, stream, got {args.tables!r}")
    torch.set_num_threads(args.threads)
    if args.clock == "thread":
        if args.threads != 1:
            parser.error("--clock thread times one thread's work: use it with --threads 1")
        if "stream" in tables:
            parser.error("--clock thread does not count the stream table's waits for the disk: use the wall clock")
        CLOCK[0] = time.thread_time

    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from transformers_k3.ops import cpu_kernel
    from transformers_k3.ops.mxfp4 import MXFP4_EXPERTS, mxfp4_experts_forward

    ALL_EXPERTS_FUNCTIONS.register(MXFP4_EXPERTS, mxfp4_experts_forward)  # (the bench's own registration)
    cpu_kernel.library()
    rate = copy_rate()
    rows = args.rows.split(",")
    E, k, D = args.experts, args.top_k, args.latent
    gen = torch.Generator().manual_seed(1)

    def routing(tokens):
        index = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
        return index, torch.rand(tokens, k, generator=gen)

    layer_shape = f", layer: latent={D} hidden={2 * D} I={args.intermediate}, prefill {args.prefill_tokens} tokens"
    print(f"# torch {torch.__version__}, {args.threads} threads, {args.clock} clock, copy rate {rate:.1f} GB/s, E={E} k={k}"
          f"{layer_shape if {'experts', 'layer'} & set(tables) else ''}")  # fmt: skip
    layers = build(args) if {"experts", "layer"} & set(tables) else None
    for table in [t for t in ("experts", "layer") if t in tables]:
        print(f"\n## {table}\n| step | row | time (ms) | tokens/s | expert MB/token | GB/s | vs bf16 |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for step, tokens in (("decode", 1), ("prefill", args.prefill_tokens)):
            index, weights = routing(tokens)
            hit = index.unique().numel()
            x = torch.randn(tokens, D if table == "experts" else 2 * D, generator=gen)
            results = {}
            for name in rows:
                layer = layers[name]
                dtype = torch.float32 if name == "fp32" else torch.bfloat16
                xs = x.to(dtype)
                if table == "experts":
                    fn = lambda: layer.experts(xs, index, weights)  # noqa: E731
                else:
                    fn = lambda: layer(xs)  # noqa: E731
                with torch.no_grad():
                    seconds = timed_median(fn, args.decode_calls) if step == "decode" else timed_best(fn, args.reps)
                per_token = expert_bytes(layer.experts) * (k if tokens == 1 else hit) / tokens
                results[name] = seconds
                ratio = results["bf16"] / seconds if "bf16" in results else float("nan")
                print(f"| {step} | {name} | {seconds * 1e3:.2f} | {tokens / seconds:,.0f} | {per_token / 1e6:.2f} | "
                      f"{per_token * tokens / seconds / 1e9:.1f} | {ratio:.2f}x |", flush=True)  # fmt: skip
            if "bf16" in results and "packed" in results:
                print(f"|  | packed vs bf16 | | | | | {results['bf16'] / results['packed']:.2f}x |")
    del layers
    if "model" in tables:
        model_table(args, rate)
    if "stream" in tables:
        stream_table(args)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
