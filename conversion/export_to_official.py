#!/usr/bin/env python
"""Export a transformers-k3 checkpoint (any layout this package writes) to the release's Kimi K3 layout,
streaming one input shard at a time: the MoE layers under block_sparse_moe.* with per-expert w1/w2/w3, A_log
zero-padded to [head_dim] in fp32, fp32 A_log/dt_bias/conv weights/o_norm/router bias, bf16 (or --dtype)
elsewhere, a shard index and a config.json with the release's keys (dtype = what was written).

    python conversion/export_to_official.py --input /ckpt/Kimi-K3-finetuned --output /ckpt/Kimi-K3-serve --mxfp4

--mxfp4 writes the routed experts as the release's compressed-tensors MXFP4 (weight_packed + E8M0
weight_scale, groups of 32): bit for bit the release's bytes for weights unchanged since loading, otherwise
compressed-tensors' rounding (power-of-two scale from the group maximum, values to nearest, ties to even).
Converting an official checkpoint in and out again reproduces its tensors bit for bit.
"""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="our checkpoint directory (config.json + safetensors)")
    parser.add_argument("--output", help="output directory (required unless --dry-run)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                        help="bf16 (the official dtype, default) or fp32; fp32 tensors of the official layout "
                             "(A_log, dt_bias, conv weights, o_norm, router bias) are always fp32")
    parser.add_argument("--mxfp4", action="store_true",
                        help="routed experts as the release's MXFP4 (compressed-tensors mxfp4-pack-quantized)")
    parser.add_argument("--dry-run", action="store_true", help="check and print the mapping; write nothing")
    parser.add_argument("--max-shard-size", default="5GB", help="output shard size (default 5GB)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if not args.dry_run and not args.output:
        parser.error("--output is required unless --dry-run")

    from transformers_k3.convert import export_to_official
    from transformers_k3.conversion.streaming import run_for_cli

    plan, status = run_for_cli(lambda: export_to_official(
        args.input, args.output, dtype=args.dtype, dry_run=args.dry_run, max_shard_size=args.max_shard_size,
        overwrite=args.overwrite, progress=not args.quiet, mxfp4=args.mxfp4,
    ))
    if status:
        return status
    if args.dry_run:
        print(plan.describe())
        print("dry run: nothing written")
    else:
        print(f"wrote {args.output}: {len(plan.outputs)} tensors, {plan.total_bytes / 1e9:.3f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
