"""Train the small K3 on CPU from local data: ``python -m transformers_k3.small.train --out DIR --minutes M``.

1. A byte-level BPE tokenizer (``tokenizers``) trained on the standard library text, with every K3 special token
   and the K3 chat template.
2. A small `KimiK3Config` with every K3 feature on: KDA and gated NoPE MLA layers, Block Attention Residuals, the
   latent MoE with SiTU-GLU (balanced by `QuantileBalancingCallback`), and the MoonViT vision tower + projector.
3. `transformers.Trainer` on `KimiK3ForConditionalGeneration`, alternating text LM batches (packed stdlib source
   and a few function-writing chats) and image-caption batches (Pillow shapes), for ``--minutes`` of wall clock:
   the learning rate follows a cosine over the time budget, not over a step count.
4. Evaluation: held-out text loss (files never trained on) against the unigram baseline; image-task accuracy on
   fresh images by scoring every candidate caption; a greedy sample.
5. ``DIR``: ``model.safetensors`` + config, tokenizer and processor files (load with `transformers_k3.load_small`
   or ``from_pretrained``), ``metrics.json`` and ``loss_curve.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from . import data

SEQ_LEN = 128


# ---------------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with ``[PAD]``/``[BOS]`` at 0/1, then every K3 special (``[EOS]`` at 2), the video placeholder,
    then the learned vocabulary; the K3 chat template attached."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from ..chat import KIMI_K3_RESPONSE_TEMPLATE
    from ..tokenization_kimi_k3 import (
        KIMI_K3_CHAT_TEMPLATE,
        KIMI_K3_SPECIAL_TOKENS,
        MEDIA_PAD,
        VIDEO_PLACEHOLDER,
        KimiK3Tokenizer,
    )

    specials = ["[PAD]", "[BOS]"] + list(KIMI_K3_SPECIAL_TOKENS) + [VIDEO_PLACEHOLDER]
    specials.insert(2, specials.pop(specials.index("[EOS]")))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = KimiK3Tokenizer(
        tokenizer_object=backend, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]",
        extra_special_tokens={"image_token": MEDIA_PAD}, model_max_length=1 << 20, padding_side="left",
    )
    tokenizer.chat_template = KIMI_K3_CHAT_TEMPLATE
    tokenizer.response_template = KIMI_K3_RESPONSE_TEMPLATE  # (the pipeline's reasoning / content split)
    for index, token in enumerate(specials):
        assert tokenizer.convert_tokens_to_ids(token) == index, token
    return tokenizer


def build_processor(tokenizer):
    from ..image_processing_kimi_k3 import KimiK3ImageProcessor
    from ..processing_kimi_k3 import KimiK3Processor
    from ..video_processing_kimi_k3 import KimiK3VideoProcessor

    # ~16 patches (4 merged tokens) per image: an input image is scaled down to about the training size (~56x56;
    # the reference's rule pads to whole 2x2 merges, so odd aspect ratios can keep a few more).
    return KimiK3Processor(image_processor=KimiK3ImageProcessor(in_patch_limit=16),
                           video_processor=KimiK3VideoProcessor(in_patch_limit=16), tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------------------- config
def small_config(tokenizer, hidden: int = 128):
    """Every K3 feature on, at a size that trains on two CPU cores in well under an hour."""
    from ..configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig, KimiK3VisionConfig

    special = tokenizer.convert_tokens_to_ids
    heads = hidden // 32
    text = KimiK3TextConfig.tiny(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=6,
        num_attention_heads=heads, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 2, qk_nope_head_dim=32,
        qk_rope_head_dim=0, v_head_dim=32, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        moe_intermediate_size=hidden // 2, routed_expert_hidden_size=hidden // 2, attn_res_block_size=2,
        pad_token_id=special("[PAD]"), bos_token_id=special("[BOS]"), eos_token_id=special("[EOS]"),
        max_position_embeddings=4096,
        linear_attn_config={"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6], "num_heads": heads,
                            "head_dim": 32},
    )
    vision = KimiK3VisionConfig(
        patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4, vt_num_attention_heads=2,
        vt_num_hidden_layers=2, vt_hidden_size=64, vt_intermediate_size=128, qkv_hidden_size=64,
        merge_kernel_size=[2, 2], text_hidden_size=hidden,
    )
    return KimiK3Config(text_config=text, vision_config=vision, media_placeholder_token_id=special("<|media_pad|>"),
                        pad_token_id=special("[PAD]"), bos_token_id=special("[BOS]"), eos_token_id=special("[EOS]"))


# ---------------------------------------------------------------------------------------------------- data
def pack(tokenizer, texts: list[str], seq_len: int = SEQ_LEN) -> torch.Tensor:
    """Concatenate documents separated by ``[EOS]`` and cut into ``[blocks, seq_len]``."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    if not texts:
        return torch.zeros(0, seq_len, dtype=torch.long)
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(eos)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def render_chat(tokenizer, messages, thinking: bool, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, thinking=thinking,
                                         add_generation_prompt=add_generation_prompt)


def image_batch(processor, captions_and_images, with_labels: bool = True) -> dict:
    """One batch of the image task: K3 chat prompts (image + question), the caption as the response. Labels cover
    only the response (caption and closing markers)."""
    tok = processor.tokenizer
    prompt = render_chat(tok, data.image_chat(), thinking=False, add_generation_prompt=True)
    texts = [render_chat(tok, data.image_chat(caption), thinking=False) for caption, _ in captions_and_images]
    images = [image for _, image in captions_and_images]
    enc = processor(images=images, text=texts, padding=True, padding_side="right", return_tensors="pt")
    prompt_len = len(processor(images=images[:1], text=[prompt])["input_ids"][0])
    batch = {k: enc[k] for k in ("input_ids", "pixel_values", "image_grid_thw")}
    if with_labels:
        labels = enc["input_ids"].clone()
        labels[:, :prompt_len] = -100
        labels[enc["attention_mask"] == 0] = -100
        batch["labels"] = labels
    return batch


class MixedBatches(Dataset):
    """Item ``i`` is a whole batch: every ``image_every``-th a fresh image-caption batch (seeded by ``i``), the others
    a random draw of packed text blocks. Use with ``per_device_train_batch_size=1`` and `unwrap`."""

    def __init__(self, blocks: torch.Tensor, processor, length: int, batch_size: int, image_batch_size: int,
                 image_every: int = 3, seed: int = 0):
        self.blocks, self.processor, self.length = blocks, processor, length
        self.batch_size, self.image_batch_size, self.image_every, self.seed = batch_size, image_batch_size, image_every, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        rng = random.Random(self.seed * 1_000_003 + i)
        if i % self.image_every == self.image_every - 1:
            examples = [data.random_image_example(rng) for _ in range(self.image_batch_size)]
            return image_batch(self.processor, [(caption, image) for image, caption in examples])
        rows = torch.tensor([rng.randrange(len(self.blocks)) for _ in range(self.batch_size)])
        ids = self.blocks[rows]
        return {"input_ids": ids, "labels": ids.clone()}


def unwrap(items: list[dict]) -> dict:
    assert len(items) == 1
    return items[0]


# ---------------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def heldout_loss(model, blocks: torch.Tensor, batch_size: int = 16) -> float:
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        ids = blocks[start:start + batch_size]
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                 reduction="sum")
        total += loss.item()
        count += ids[:, 1:].numel()
    return total / count


def unigram_baseline(train_blocks: torch.Tensor, heldout_blocks: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the held-out targets under the train unigram distribution (add-one smoothed)."""
    counts = torch.bincount(train_blocks.reshape(-1), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[heldout_blocks[:, 1:].reshape(-1)].mean())


@torch.no_grad()
def image_accuracy(model, processor, n_images: int = 96, seed: int = 12345) -> dict:
    """Score every candidate caption by the model's summed loss on the response; accuracy of the lowest."""
    rng = random.Random(seed)
    candidates = data.captions()
    correct = colour_ok = shape_ok = 0
    for _ in range(n_images):
        image, truth = data.random_image_example(rng)
        batch = image_batch(processor, [(c, image) for c in candidates])
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        labels = batch["labels"][:, 1:]
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels, ignore_index=-100,
                                                reduction="none").sum(-1)
        guess = candidates[int(nll.argmin())]
        correct += guess == truth
        colour_ok += guess.split()[1] == truth.split()[1]
        shape_ok += guess.split()[2] == truth.split()[2]
    return {"image_accuracy": correct / n_images, "image_chance": 1 / len(candidates),
            "image_colour_accuracy": colour_ok / n_images, "image_colour_chance": 1 / len(data.COLOURS),
            "image_shape_accuracy": shape_ok / n_images, "image_shape_chance": 1 / len(data.SHAPES),
            "image_eval_images": n_images}


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, max_new_tokens: int = 48) -> str:
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False, repetition_penalty=1.0,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ..balancing import QuantileBalancingCallback
    from ..modeling_kimi_k3_vl import KimiK3ForConditionalGeneration

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--minutes", type=float, default=55.0, help="wall-clock budget of the training loop")
    parser.add_argument("--vocab-size", type=int, default=3072)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-batch-size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-files", type=int, default=None, help="use only the first N stdlib files (quick runs)")
    parser.add_argument("--eval-blocks", type=int, default=160)
    parser.add_argument("--eval-images", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    torch.manual_seed(args.seed)

    train_files, held_files = data.split_files(args.max_files)
    train_texts = [t for t in map(data.read_text, train_files) if t]
    held_texts = [t for t in map(data.read_text, held_files) if t]
    from ..tokenization_kimi_k3 import build_test_tokenizer

    template_tok = build_test_tokenizer()
    chats = [render_chat(template_tok, c["messages"], c["thinking"]) for c in data.function_chats(train_texts)]
    image_texts = [render_chat(template_tok, data.image_chat(c), thinking=False) for c in data.captions()] * 50
    tokenizer = train_tokenizer(train_texts + chats + image_texts, args.vocab_size)
    processor = build_processor(tokenizer)
    train_blocks = pack(tokenizer, train_texts + chats)
    held_blocks = pack(tokenizer, held_texts)
    print(f"[{time.time() - t0:.0f}s] tokenizer: {len(tokenizer)} ids; train {train_blocks.numel():,} tokens "
          f"({len(train_files)} files + {len(chats)} chats), held-out {held_blocks.numel():,} tokens "
          f"({len(held_files)} files)", flush=True)

    config = small_config(tokenizer, args.hidden)
    model = KimiK3ForConditionalGeneration(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{time.time() - t0:.0f}s] model: {n_params:,} parameters", flush=True)

    budget_s = args.minutes * 60.0
    warmup = 30

    class TimeBudget(TrainerCallback):
        """Stops training when the wall-clock budget is spent (the LR schedule reaches zero at the same time)."""

        def on_train_begin(self, *a, **k):
            self.start = time.time()

        def on_step_end(self, args_, state, control, **kwargs):
            if time.time() - self.start >= budget_s:
                control.should_training_stop = True
                control.should_log = True

    budget = TimeBudget()
    budget.start = time.time()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_factor(step: int) -> float:
        frac = min(1.0, (time.time() - budget.start) / budget_s)
        return min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    max_steps = 100_000
    dataset = MixedBatches(train_blocks, processor, max_steps, args.batch_size, args.image_batch_size, seed=args.seed)
    training_args = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=1, max_steps=max_steps, logging_steps=10,
        save_strategy="no", report_to=[], remove_unused_columns=False, dataloader_num_workers=0,
        max_grad_norm=1.0, disable_tqdm=True, seed=args.seed, use_cpu=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=unwrap,
                      optimizers=(optimizer, scheduler), callbacks=[budget])
    QuantileBalancingCallback(log_per_layer=False).attach(trainer)
    train_start = time.time()
    trainer.train()
    train_s = time.time() - train_start
    print(f"[{time.time() - t0:.0f}s] trained {trainer.state.global_step} steps in {train_s / 60:.1f} min", flush=True)

    rows = [r for r in trainer.state.log_history if "loss" in r]
    with open(out / "loss_curve.csv", "w", newline="") as f:
        writer = csv.writer(f)
        keys = ["step", "loss", "learning_rate", "grad_norm"]
        extra = sorted({k for r in rows for k in r if k not in keys and k != "epoch"})
        writer.writerow(keys + extra)
        for r in rows:
            writer.writerow([r.get(k, "") for k in keys + extra])

    model.eval()
    eval_blocks = held_blocks[torch.randperm(len(held_blocks), generator=torch.Generator().manual_seed(0))
                              [: args.eval_blocks]]
    metrics = {
        "parameters": n_params, "vocab_size": len(tokenizer), "train_tokens": train_blocks.numel(),
        "train_steps": trainer.state.global_step, "train_minutes": round(train_s / 60, 2),
        "train_files": len(train_files), "heldout_files": len(held_files), "seq_len": SEQ_LEN,
        "batch_size": args.batch_size, "image_batch_size": args.image_batch_size,
        "heldout_tokens": int(eval_blocks[:, 1:].numel()),
        "heldout_loss": heldout_loss(model, eval_blocks),
        "unigram_baseline": unigram_baseline(train_blocks, eval_blocks, len(tokenizer)),
        "first_logged_loss": rows[0]["loss"] if rows else None, "last_logged_loss": rows[-1]["loss"] if rows else None,
    }
    print(f"[{time.time() - t0:.0f}s] held-out loss {metrics['heldout_loss']:.3f} vs unigram "
          f"{metrics['unigram_baseline']:.3f} nats/token", flush=True)
    metrics.update(image_accuracy(model, processor, args.eval_images))
    print(f"[{time.time() - t0:.0f}s] image accuracy {metrics['image_accuracy']:.3f} (chance "
          f"{metrics['image_chance']:.3f})", flush=True)

    # Save: fp32 when it fits in ~20 MB, else bf16.
    dtype = torch.float32 if n_params * 4 <= 20e6 else torch.bfloat16
    # A model this small loops on greedy decoding ("the number of the number of ..."); the shipped generation
    # default damps tokens already seen (repetition_penalty 1.2, greedy still: deterministic). Not a no-repeat
    # n-gram rule: that would forbid a chat answer's closing <|end_of_msg|>, whose n-gram every user message in the
    # prompt already ends with. `metrics["sample_greedy"]` is plain greedy, so the number reflects the model alone.
    model.generation_config.repetition_penalty = 1.2
    model.generation_config.do_sample = False  # (the text-generation pipeline samples unless told otherwise)
    model.to(dtype).save_pretrained(out)
    processor.save_pretrained(out)
    model.to(torch.float32)
    metrics["checkpoint_dtype"] = str(dtype).replace("torch.", "")
    metrics["checkpoint_bytes"] = os.path.getsize(out / "model.safetensors")

    from . import load_small

    reloaded, proc = load_small(out)
    metrics["sample_prompt"] = "def fibonacci(n):"
    metrics["sample_greedy"] = greedy(reloaded, proc.tokenizer, metrics["sample_prompt"])
    print(f"sample: {metrics['sample_prompt']}{metrics['sample_greedy']}", flush=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
