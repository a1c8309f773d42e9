#!/usr/bin/env python
"""Convert a Kimi Linear checkpoint (Moonshot's original layout, or transformers' in-tree
KimiLinearForCausalLM layout) to a Kimi K3 checkpoint with every K3-only feature off: the same function
as transformers' Kimi Linear, run by this package's model. Streams one input shard at a time.

    python conversion/convert_kimi_linear_to_k3.py --input /ckpt/Kimi-Linear-48B-A3B --output /ckpt/kl-k3
"""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="Kimi Linear checkpoint directory (config.json + safetensors)")
    parser.add_argument("--output", help="output directory (required unless --dry-run)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="output dtype (default bf16)")
    parser.add_argument("--dry-run", action="store_true", help="check and print the mapping; write nothing")
    parser.add_argument("--max-shard-size", default="5GB", help="output shard size (default 5GB)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if not args.dry_run and not args.output:
        parser.error("--output is required unless --dry-run")

    from transformers_k3.convert import convert_kimi_linear_checkpoint
    from transformers_k3.conversion.streaming import run_for_cli

    plan, status = run_for_cli(lambda: convert_kimi_linear_checkpoint(
        args.input, args.output, dtype=args.dtype, dry_run=args.dry_run, max_shard_size=args.max_shard_size,
        overwrite=args.overwrite, progress=not args.quiet,
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
