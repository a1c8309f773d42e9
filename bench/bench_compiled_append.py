"""What a compiled segment step does with the growing cache's latent buffers (issue 47): the graph's whole-buffer
copies, counted from the AOT graphs, and the step's peak memory.

The tiny K3 (two MLA layers) fills a growing `KimiK3HybridCache` with a no-grad context, then runs one truncated-mode
segment step (forward + backward) of ``torch.compile(model, fullgraph=True)`` on it, through an aot_autograd backend
that keeps the forward and backward graphs it is given (aot_eager otherwise: no code generation). Printed per graph:
the nodes that make a tensor the size of an MLA latent buffer (``[B, capacity, D]``: the functionalized in-place
append is a ``slice_scatter`` of the whole buffer, returned as a mutated input and copied back into it), the graph's
outputs of that size, and the bytes the step allocates (a second call, after compilation; the profiler's memory
events). Then whether
the cache holds eager's latents after the step and after a following eager step.

    python bench/bench_compiled_append.py                           # 16K context, 256-token segment
    python bench/bench_compiled_append.py --context 65536 --segment 256
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._dynamo.backends.common import aot_autograd

from transformers_k3 import KimiK3ForCausalLM, KimiK3HybridCache, KimiK3TextConfig, kernelize
from transformers_k3.cache import KimiK3MLACacheLayer

def allocated(fn, size: int) -> tuple[object, int, int]:
    """``(fn(), bytes allocated while it runs, how many allocations were of `size` bytes)``, from the profiler's
    memory events (each operator's own allocations net of its own frees, freed later or not)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    sizes = [event.self_cpu_memory_usage for event in prof.events() if event.self_cpu_memory_usage > 0]
    return out, sum(sizes), sum(1 for s in sizes if s == size)


def buffer_sized(graph: torch.fx.GraphModule, shapes: set) -> tuple[dict, int]:
    """``({op name: count}, outputs)`` of `graph`'s nodes whose value has one of `shapes`."""
    nodes = {}
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        if node.op == "call_function" and isinstance(value, torch.Tensor) and tuple(value.shape) in shapes:
            name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            nodes[name] = nodes.get(name, 0) + 1
    output = next(node for node in graph.graph.nodes if node.op == "output")
    outputs = sum(1 for arg in output.args[0] if isinstance(arg, torch.fx.Node)
                  and isinstance(arg.meta.get("val"), torch.Tensor) and tuple(arg.meta["val"].shape) in shapes)
    return nodes, outputs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--segment", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = kernelize(KimiK3ForCausalLM(KimiK3TextConfig.tiny())).train()
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.context + 2 * args.segment),
                        generator=torch.Generator().manual_seed(1))
    context, first, second = (ids[:, : args.context], ids[:, args.context: args.context + args.segment],
                              ids[:, args.context + args.segment:])

    def filled() -> KimiK3HybridCache:
        # (room for both segments reserved: the buffer never grows, so a copy in the graph is the append's)
        cache = KimiK3HybridCache(model.config, max_cache_len=ids.shape[1])
        with torch.no_grad():  # (in chunks: a long context's prefill attends blockwise)
            for start in range(0, args.context, 8192):
                model(context[:, start: start + 8192], past_key_values=cache, use_cache=True)
        return cache

    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return graph

    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep,
                                                                             keep_inference_input_mutations=True))

    def step(forward, cache):
        loss = forward(input_ids=first, past_key_values=cache, labels=first).loss
        loss.backward()
        cache.detach_()
        return loss.detach()

    cache = filled()
    layers = [layer for layer in cache.layers if isinstance(layer, KimiK3MLACacheLayer)]
    shapes = {tuple(layer.latent.shape) for layer in layers}
    buffer_bytes = sum(layer.latent.nbytes for layer in layers)
    started = time.perf_counter()
    step(compiled, cache)
    compile_s = time.perf_counter() - started
    print(f"context {args.context}, segment {args.segment}, batch {args.batch}; MLA layers {len(layers)}, buffers "
          f"{sorted(shapes)} ({buffer_bytes / 2**20:.2f} MiB together); first call {compile_s:.1f} s")
    for kind, graph in zip(("forward", "backward"), graphs):
        nodes, outputs = buffer_sized(graph, shapes)
        print(f"  {kind} graph: buffer-sized nodes {nodes or 'none'}, buffer-sized outputs {outputs}")

    model.zero_grad(set_to_none=True)
    cache = filled()
    compiled_loss, total, buffers = allocated(lambda: step(compiled, cache), layers[0].latent.nbytes)
    print(f"  second call: {total / 2**20:.1f} MiB allocated, {buffers} allocations of one buffer's size "
          f"({layers[0].latent.nbytes / 2**20:.2f} MiB)")
    compiled_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]

    model.zero_grad(set_to_none=True)
    reference = filled()
    eager_loss = step(model, reference)
    eager_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    latents = max((cache.layers[i].held_latents() - reference.layers[i].held_latents()).abs().max().item()
                  for i, layer in enumerate(cache.layers) if isinstance(layer, KimiK3MLACacheLayer))
    gradient = max((a - b).abs().max().item() for a, b in zip(compiled_grads, eager_grads))
    with torch.no_grad():
        after = model(second, past_key_values=cache).logits
        want = model(second, past_key_values=reference).logits
    print(f"  loss compiled {compiled_loss.item():.6f} eager {eager_loss.item():.6f}; largest gradient difference "
          f"{gradient:.2e}; cache latents differ from eager's by {latents:.2e}; next eager step's logits differ by "
          f"{(after - want).abs().max().item():.2e}")
    torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
