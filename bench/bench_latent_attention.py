"""MLA's absorbed decode attention over a cached latent: `transformers_k3::latent_attention` (one pass over the
latent) against the two passes it replaces (`latent_scores`, an fp32 softmax, the probabilities times the latent),
in one process, beside the memory roofline (the latent's bytes / the bandwidth of a large `x.sum()`).

    python bench/bench_latent_attention.py                      # the bench model's shape: 4 query rows, 160 wide
    python bench/bench_latent_attention.py --contexts 1024 16384 131072 --rows 4 --dim 160 --value-dim 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def best_of(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth(gib: float) -> float:
    """Bytes per second of an fp32 ``x.sum()`` over ``gib`` GiB (best of 7)."""
    x = torch.ones(int(gib * 2**28))
    x.sum()
    return x.nbytes / min(best_of(x.sum, 1) for _ in range(7))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 131072])
    parser.add_argument("--rows", type=int, default=4, help="query rows (heads x new tokens)")
    parser.add_argument("--dim", type=int, default=160, help="latent width (kv_lora_rank + rope)")
    parser.add_argument("--value-dim", type=int, default=128, help="kv_lora_rank")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the roofline's x.sum()")
    args = parser.parse_args(argv)

    from transformers_k3.ops import cpu_kernel

    torch.set_num_threads(args.threads)
    if cpu_kernel.library() is None:
        raise SystemExit("the CPU kernels are not built here: nothing to compare")
    bw = bandwidth(args.bandwidth_gib)
    print(f"torch {torch.__version__}, {args.threads} threads, x.sum() bandwidth {bw / 1e9:.0f} GB/s")
    print("| dtype | context | one pass (us) | two passes (us) | two / one | roofline (us) | one pass / roofline |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for seq in args.contexts:
            # a cache's latent: a prefix of a longer reserved buffer
            buffer = torch.randn(1, seq + 64, args.dim, generator=gen).to(dtype)
            latent = buffer[:, :seq]
            queries = (0.3 * torch.randn(1, args.rows, args.dim, generator=gen)).to(dtype)

            def one():
                return torch.ops.transformers_k3.latent_attention(latent, queries, 0.1, args.value_dim, 1)

            def two():
                scores = cpu_kernel.latent_scores(latent, queries) * 0.1
                probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
                return torch.matmul(probs, latent)[..., : args.value_dim]

            torch.testing.assert_close(one().to(dtype), two(), atol=2e-2 if dtype is torch.bfloat16 else 1e-5,
                                       rtol=2e-2 if dtype is torch.bfloat16 else 1e-4)  # fmt: skip
            t_one, t_two = best_of(one, args.reps), best_of(two, args.reps)
            roof = latent.numel() * latent.element_size() / bw
            print(f"| {name} | {seq:,} | {1e6 * t_one:.0f} | {1e6 * t_two:.0f} | {t_two / t_one:.2f}x | "
                  f"{1e6 * roof:.0f} | {t_one / roof:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
