#!/usr/bin/env python
"""Convert an official Kimi K3 checkpoint (text-only or multimodal; bf16 or MXFP4 experts) to the
transformers-k3 layout, streaming one input shard at a time.

    python conversion/convert_k3_official_to_hf.py --input /ckpt/Kimi-K3 --output /ckpt/Kimi-K3-hf

The output has fused expert tensors, our config.json, the release's tokenizer/processor files and a
transformers fast tokenizer converted from tiktoken.model. Nothing is written unless the whole
conversion succeeds (the output is assembled under a temporary name and renamed at the end).
"""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="official checkpoint directory (config.json + safetensors)")
    parser.add_argument("--output", help="output directory (required unless --dry-run)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                        help="dtype of the weights and of the dequantised experts (tensors the model keeps in fp32 "
                             "stay fp32); default bf16")
    parser.add_argument("--keep-quantized", action="store_true",
                        help="copy MXFP4 experts bit for bit as per-expert weight_packed/weight_scale tensors instead of "
                             "dequantising them; from_pretrained dequantises them at load time (the model in memory is "
                             "bf16/fp32 either way, this only saves disk space)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check every tensor against the config and print the mapping; write nothing")
    parser.add_argument("--max-shard-size", default="5GB", help="output shard size, e.g. 5GB or 500MB (default 5GB)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument("--no-tokenizer", action="store_true", help="copy the tokenizer files without converting them")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if not args.dry_run and not args.output:
        parser.error("--output is required unless --dry-run")

    from transformers_k3.convert import convert_official_checkpoint
    from transformers_k3.conversion.streaming import run_for_cli

    plan, status = run_for_cli(lambda: convert_official_checkpoint(
        args.input, args.output, dtype=args.dtype, keep_quantized=args.keep_quantized, dry_run=args.dry_run,
        max_shard_size=args.max_shard_size, overwrite=args.overwrite, progress=not args.quiet,
        convert_tokenizer=not args.no_tokenizer,
    ))
    if status:
        return status
    if args.dry_run:
        print(plan.describe())
        print("dry run: every tensor checked against the config; nothing written")
    else:
        print(f"wrote {args.output}: {len(plan.outputs)} tensors, {plan.total_bytes / 1e9:.3f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
