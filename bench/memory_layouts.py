"""Memory arithmetic of the full Kimi K3 for a few multi-GPU layouts: weights per rank (bf16, MXFP4 experts),
the MLA latent cache per token and the KDA state per sequence.

    python bench/memory_layouts.py            # the release's config (KimiK3Config() + KimiK3VisionConfig())
    python bench/memory_layouts.py --markdown # the table as the README shows it

Parameters are counted on a meta-device model built from the config (nothing is allocated), by module:

* routed experts (``mlp.experts.*``): split over the expert-parallel ranks (EP), bf16 or the release's MXFP4
  (a 4-bit E2M1 value per weight plus one E8M0 byte per 32: 4.25 bits per weight);
* everything else that is a matrix (attention projections, shared experts, the dense MLP, the embeddings and
  head, the vision tower): split over the tensor-parallel ranks (TP) of a node, bf16;
* 1-D tensors (norms, ``A_log``, ``dt_bias``, biases) and the routers' ``[E, hidden]`` gates: replicated.

Cache (``KimiK3HybridCache``; see cache.py): an MLA layer keeps ``kv_lora_rank + qk_rope_head_dim`` values per
token (bf16 here), the same on every TP rank (the latent is shared by all heads); a KDA layer keeps an fp32
``[heads, head_dim, head_dim]`` state and the short convolutions' last ``kernel - 1`` inputs of q, k and v per
sequence, split over TP ranks by heads.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

GB = 1e9


@dataclasses.dataclass
class Counts:
    routed: int = 0  # routed-expert weights (EP-split)
    sharded: int = 0  # other matrices (TP-split)
    replicated: int = 0  # 1-D tensors and router gates

    @property
    def total(self) -> int:
        return self.routed + self.sharded + self.replicated


def count_parameters(config) -> Counts:
    from transformers_k3 import KimiK3ForCausalLM, KimiK3ForConditionalGeneration

    with torch.device("meta"):
        model = (KimiK3ForConditionalGeneration if getattr(config, "vision_config", None) is not None
                 else KimiK3ForCausalLM)(config)
    counts = Counts()
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            counts.routed += param.numel()
        elif param.dim() <= 1 or name.endswith("mlp.gate.weight"):
            counts.replicated += param.numel()
        else:
            counts.sharded += param.numel()
    return counts


def cache_sizes(text_config, latent_dtype=torch.bfloat16, conv_dtype=torch.bfloat16) -> tuple[int, int]:
    """(bytes of MLA latent per token, bytes of KDA state per sequence) for the whole model on one device."""
    mla = text_config.layer_types.count("full_attention")
    kda = text_config.num_hidden_layers - mla
    lac = text_config.linear_attn_config
    heads, dim, kernel = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    latent = mla * (text_config.kv_lora_rank + text_config.qk_rope_head_dim) * latent_dtype.itemsize
    state = kda * (heads * dim * dim * 4 + 3 * heads * dim * (kernel - 1) * conv_dtype.itemsize)
    return latent, state


LAYOUTS = (("1 node, 8 GPUs", 8, 8), ("2 nodes, 16 GPUs", 8, 16), ("4 nodes, 32 GPUs", 8, 32))


def per_rank(counts: Counts, tp: int, ep: int, expert_bits: float) -> float:
    """Weight bytes on one rank: its share of the experts, of the other matrices, and the replicated rest."""
    return counts.routed / ep * expert_bits / 8 + counts.sharded / tp * 2 + counts.replicated * 2


def rows(config) -> tuple[Counts, list[tuple[str, int, int, float, float]], tuple[int, int]]:
    counts = count_parameters(config)
    table = [(label, tp, ep, per_rank(counts, tp, ep, 16), per_rank(counts, tp, ep, 4.25))
             for label, tp, ep in LAYOUTS]
    return counts, table, cache_sizes(config.get_text_config())


def main(argv=None) -> int:
    from transformers_k3 import KimiK3Config, KimiK3VisionConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="print the README's table")
    args = parser.parse_args(argv)
    config = KimiK3Config(vision_config=KimiK3VisionConfig())
    counts, table, (latent, state) = rows(config)
    text = config.get_text_config()
    print(f"parameters: {counts.total / 1e12:.3f} T in all; routed experts {counts.routed / 1e12:.3f} T, other "
          f"matrices {counts.sharded / 1e9:.1f} B, replicated {counts.replicated / 1e6:.1f} M")
    print(f"whole model on one device: bf16 {counts.total * 2 / GB:,.0f} GB; MXFP4 experts "
          f"{per_rank(counts, 1, 1, 4.25) / GB:,.0f} GB")
    print(f"cache: MLA latent {latent / 1024:.1f} KiB per token (bf16, {text.layer_types.count('full_attention')} "
          f"layers, replicated over TP); KDA state {state / 2**20:.0f} MiB per sequence (fp32 state + bf16 conv "
          f"tails, split over TP)")
    if args.markdown:
        print("\n| layout | TP x EP | weights per GPU, bf16 | weights per GPU, MXFP4 experts | latent per GPU at 128K "
              "tokens | KDA state per GPU per sequence |")
        print("|---|---|---|---|---|---|")
    for label, tp, ep, bf16, mxfp4 in table:
        cells = (label, f"{tp} x {ep}", f"{bf16 / GB:,.0f} GB", f"{mxfp4 / GB:,.0f} GB",
                 f"{latent * 131072 / GB:.1f} GB", f"{state / tp / 2**20:.0f} MiB")
        print("| " + " | ".join(cells) + " |" if args.markdown else "  " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
