#!/usr/bin/env python
"""Check that other engines load a checkpoint in the release's layout and compute what transformers-k3 computes.

    python conversion/check_engines.py /ckpt/Kimi-K3-serve              # engines importable here
    python conversion/check_engines.py /ckpt/Kimi-K3-serve --mlx-python /venvs/mlx/bin/python

The directory is one `transformers_k3.export_release` (or `export_to_official.py --mxfp4`) wrote, or the release
itself. The reference is transformers-k3 in this interpreter: the model loaded in fp32 with its MXFP4 experts
packed, the last prompt token's logits and a greedy continuation. Each engine runs in its own interpreter (its own
dependencies, e.g. mlx-lm's transformers pin, never enter this one): ``--mlx-python`` or ``K3_MLX_PYTHON``, else this
interpreter when it imports mlx_lm. Every engine loads the same directory, casts its floating weights to fp32 (packed
codes and scales keep their integer types) and returns the same two things. The table says whether it loaded, kept
the experts packed, how far its logits are from ours (max abs, max abs over max |logit|) and how many greedy tokens
agree. ``--json`` writes the rows for scripts and tests. Exit status 1 when an engine that loaded differs by more than
``--rtol``, greedy decoding diverges, or the experts did not stay packed. docs/mxfp4.md "Other engines" gives the
tolerance and what each engine does.

llama.cpp: its K3 converter (`convert_hf_to_gguf.py`) ships with llama.cpp's sources, not with the `gguf` package;
the llama-cpp-python sdist vendors one (``pip download --no-deps --no-binary :all: llama-cpp-python``, then
``--llama-cpp <unpacked>/vendor/llama.cpp``). The row converts the directory with it (the directory needs its
tokenizer, as any llama.cpp conversion does) and reads the GGUF back with that converter's `gguf` reader: the expert
stacks must be MXFP4 and, dequantized, equal ours. Running the GGUF needs a llama.cpp build, which this does not do.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs inside the engine's interpreter: argv = directory, prompt ids (JSON), steps, config overrides (JSON or "null").
MLX_PROBE = r"""
import json, sys
from pathlib import Path
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
path, ids, steps, over = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
model, config = load_model(path, model_config=over)
model.set_dtype(mx.float32)  # floating parameters only: mxfp4 codes (uint32) and scales (uint8) stay as loaded
params = dict(tree_flatten(model.parameters()))
experts = {k: str(v.dtype).rsplit(".", 1)[-1] for k, v in params.items() if ".switch_mlp." in k}
x = mx.array([ids])
logits = model(x)[0, -1].astype(mx.float32)
cache = model.make_cache()
out = model(x, cache=cache)[:, -1]
tokens = []
for _ in range(steps):
    token = int(mx.argmax(out, axis=-1).item())
    tokens.append(token)
    out = model(mx.array([[token]]), cache=cache)[:, -1]
print(json.dumps({"logits": logits.tolist(), "greedy": tokens, "quantization": config.get("quantization"),
                  "expert_dtypes": sorted(set(experts.values()))}))
"""


def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def reference(directory: Path, ids: list[int], steps: int):
    """transformers-k3's last-token logits (fp32) and greedy tokens, the experts loaded packed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    import transformers_k3  # noqa: F401  (registers the classes and the quantizer)

    auto = AutoModelForImageTextToText if "text_config" in _config(directory) else AutoModelForCausalLM
    model = auto.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1].float()
        greedy = model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return logits, greedy[0, len(ids):].tolist()


def _interpreter_with(module: str, explicit: str | None) -> str | None:
    """The interpreter to run an engine in: the one named, else this one if it imports ``module``."""
    if explicit:
        return explicit
    import importlib.util

    return sys.executable if importlib.util.find_spec(module) is not None else None


def run_mlx(directory: Path, ids: list[int], steps: int, python: str | None) -> dict:
    python = _interpreter_with("mlx_lm", python or os.environ.get("K3_MLX_PYTHON"))
    if python is None:
        return {"engine": "mlx-lm", "loaded": False, "note": "mlx_lm not importable (--mlx-python / K3_MLX_PYTHON)"}
    overrides, note = None, ""
    if _config(directory).get("model_type") == "kimi_linear":  # text-only release: mlx-lm maps kimi_linear elsewhere
        overrides, note = {"model_type": "kimi_k3"}, "model_type kimi_k3 passed (text-only config)"
    done = subprocess.run([python, "-c", MLX_PROBE, str(directory), json.dumps(ids), str(steps), json.dumps(overrides)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return {"engine": "mlx-lm", "loaded": False, "note": done.stderr.strip().splitlines()[-1:] or ["failed"]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    packed = result["expert_dtypes"] == ["uint32", "uint8"] and (result["quantization"] or {}).get("mode") == "mxfp4"
    return {"engine": "mlx-lm", "loaded": True, "packed": packed, "logits": result["logits"],
            "greedy": result["greedy"], "note": note}


def run_llama_cpp(directory: Path, llama_cpp: str | None) -> dict:
    """Converts with llama.cpp's own converter where one is given, then reads the GGUF back: the routed experts
    must be MXFP4 and, dequantized, equal ours dequantized (the repack only moves bits)."""
    row = {"engine": "llama.cpp (convert + gguf reader)", "loaded": False}
    script = Path(llama_cpp) / "convert_hf_to_gguf.py" if llama_cpp else None
    if script is None or not script.is_file():
        row["note"] = "no convert_hf_to_gguf.py (--llama-cpp DIR; it is not in the gguf package)"
        return row
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model.gguf"
        done = subprocess.run([sys.executable, str(script), str(directory), "--outfile", str(out)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            row["note"] = (done.stderr.strip().splitlines() or ["convert failed"])[-1]
            return row
        sys.path.insert(0, str(script.parent / "gguf-py"))  # the converter's own gguf, as it wrote with it
        from gguf import GGUFReader
        from gguf.quants import dequantize

        tensors = GGUFReader(out).tensors
        experts = [t for t in tensors if "_exps." in t.name]
        row.update(loaded=True, packed=bool(experts) and all(t.tensor_type.name == "MXFP4" for t in experts),
                   expert_max_abs=_gguf_expert_diff(directory, experts, dequantize),
                   note=f"{len(tensors)} tensors, {len(experts)} expert stacks {sorted({t.tensor_type.name for t in experts})}")
    return row


def _gguf_expert_diff(directory: Path, experts, dequantize) -> float:
    """Largest difference between a GGUF's expert stacks and the directory's experts, both dequantized."""
    import torch
    from safetensors import safe_open

    from transformers_k3.conversion import dequantize_mxfp4

    files = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            files.update({name: path for name in f.keys()})
    root = "language_model." if any(n.startswith("language_model.") for n in files) else ""

    def tensor(name):
        with safe_open(files[name], "pt") as f:
            return f.get_tensor(name)

    worst = 0.0
    for t in experts:
        _, layer, kind, _ = t.name.split(".")
        w = {"ffn_gate_exps": "w1", "ffn_down_exps": "w2", "ffn_up_exps": "w3"}[kind]
        theirs = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        prefix = f"{root}model.layers.{layer}.block_sparse_moe.experts."
        ours = torch.stack([dequantize_mxfp4(tensor(f"{prefix}{e}.{w}.weight_packed"),
                                             tensor(f"{prefix}{e}.{w}.weight_scale"), torch.float32)
                            for e in range(theirs.shape[0])])
        worst = max(worst, (theirs - ours).abs().max().item() if theirs.shape == ours.shape else float("inf"))
    return worst


def compare(row: dict, logits, greedy: list[int]) -> dict:
    import torch

    if "logits" in row:
        theirs = torch.tensor(row.pop("logits"))
        diff = (theirs - logits).abs().max().item()
        row.update(max_abs=diff, max_rel=diff / logits.abs().max().item(),
                   greedy_match=sum(a == b for a, b in zip(row.pop("greedy"), greedy)), steps=len(greedy))
    return row


def table(rows: list[dict]) -> str:
    lines = ["| engine | loaded | experts packed | logits max abs | max abs / max abs logit | greedy match "
             "| expert values max abs | note |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        num = (lambda k: f"{r[k]:.2e}" if k in r else "-")
        match = f"{r['greedy_match']}/{r['steps']}" if "greedy_match" in r else "-"
        note = r.get("note", "")
        lines.append(f"| {r['engine']} | {'yes' if r['loaded'] else 'no'} | {r.get('packed', '-')} | {num('max_abs')} "
                     f"| {num('max_rel')} | {match} | {num('expert_max_abs')} | {note if isinstance(note, str) else ' '.join(note)} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="a checkpoint in the release's layout")
    parser.add_argument("--reference", type=Path,
                        help="compute our side from this directory instead (e.g. the release, to check an export)")
    parser.add_argument("--mlx-python", help="interpreter with mlx and mlx-lm (default: K3_MLX_PYTHON, else this one)")
    parser.add_argument("--llama-cpp", help="a llama.cpp source directory holding convert_hf_to_gguf.py")
    parser.add_argument("--steps", type=int, default=16, help="greedy tokens to compare (default 16)")
    parser.add_argument("--prompt", default="5,17,300,42,9,77,123,400", help="prompt token ids, comma-separated")
    parser.add_argument("--rtol", type=float, default=1e-4,
                        help="largest logits difference allowed, over the largest |logit| (default 1e-4)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)

    ids = [int(i) for i in args.prompt.split(",")]
    logits, greedy = reference(args.reference or args.directory, ids, args.steps)
    rows = [compare(run_mlx(args.directory, ids, args.steps, args.mlx_python), logits, greedy),
            run_llama_cpp(args.directory, args.llama_cpp)]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if ("max_rel" in r and (r["max_rel"] > args.rtol or r["greedy_match"] < r["steps"]))
           or r.get("expert_max_abs", 0) != 0 or r.get("packed") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
