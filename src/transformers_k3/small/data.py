"""Local training data for the small K3: nothing is downloaded.

Text: the Python standard library's own source files (code, comments and docstrings), found through
``sysconfig.get_paths()["stdlib"]``. The split is by file and deterministic (a hash of the relative path), so
held-out loss measures code the model never saw. A few functions are also rendered as chats with the K3 template
(user: the docstring's first line, assistant: optional thinking + the function) so chat prompts are not foreign.

Images: shapes x colours drawn with Pillow on small canvases (56x56 pixels: 16 patches of 14x14, 4 merged tokens),
captioned "a red circle". The caption is the assistant's response to an image question in the K3 chat format.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
import textwrap
from pathlib import Path

SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = {
    "red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220),
    "yellow": (235, 215, 20), "purple": (140, 40, 170), "orange": (245, 140, 20),
}
IMAGE_QUESTION = "What is in the image?"
_SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "idlelib", "turtledemo", "lib2to3", "ensurepip",
               "__pycache__", "pydoc_data", "tkinter", "encodings"}


def stdlib_files(max_bytes: int = 400_000) -> list[Path]:
    """The standard library's ``.py`` files (tests, data tables and very large generated files left out), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_PARTS & set(rel.parts) or path.stat().st_size > max_bytes:
            continue
        files.append(path)
    return files


def is_held_out(path: Path, fraction: float = 0.05) -> bool:
    """Deterministic split by file: a file is held out when the hash of its path (relative to the stdlib) is low."""
    root = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def split_files(max_files: int | None = None, fraction: float = 0.05) -> tuple[list[Path], list[Path]]:
    files = stdlib_files()
    if max_files is not None:
        files = files[:max_files]
    train = [f for f in files if not is_held_out(f, fraction)]
    held = [f for f in files if is_held_out(f, fraction)]
    return train, held


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def function_chats(texts: list[str], limit: int = 3000, seed: int = 0) -> list[dict]:
    """``{"messages": [...], "thinking": bool}`` for small documented functions: the question is the docstring's
    first line, the thinking names the function and its arguments, the response is the source."""
    rng = random.Random(seed)
    chats = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            source = ast.get_source_segment(text, node)
            if not doc or not source or len(source) > 600:
                continue
            source = textwrap.dedent(" " * node.col_offset + source)
            first = doc.strip().splitlines()[0]
            args = ", ".join(a.arg for a in node.args.args) or "no arguments"
            thinking = rng.random() < 0.5
            messages = [{"role": "user", "content": f"Write a Python function: {first}"},
                        {"role": "assistant", "content": source,
                         "reasoning_content": f"The function is `{node.name}`; it takes {args}."}]
            chats.append({"messages": messages, "thinking": thinking})
    rng.shuffle(chats)
    return chats[:limit]


# ------------------------------------------------------------------------------------------------------ images
def captions() -> list[str]:
    return [f"a {colour} {shape}" for colour in COLOURS for shape in SHAPES]


def draw_shape(shape: str, colour: str, size: int = 56, rng: random.Random | None = None):
    """One RGB image of ``size x size`` pixels: a light random background and the shape, at a random position and
    scale (at least half the canvas, so every shape spans several 14-pixel patches and its outline is visible)."""
    from PIL import Image, ImageDraw

    rng = rng or random.Random()
    bg = tuple(rng.randint(200, 255) for _ in range(3))
    image = Image.new("RGB", (size, size), bg)
    draw = ImageDraw.Draw(image)
    side = rng.randint(size // 2, int(size * 0.9))
    x0, y0 = rng.randint(0, size - side), rng.randint(0, size - side)
    x1, y1 = x0 + side, y0 + side
    fill = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLOURS[colour])
    if shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=fill)
    elif shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
    elif shape == "cross":
        w = side // 3
        draw.rectangle([x0 + w, y0, x1 - w, y1], fill=fill)
        draw.rectangle([x0, y0 + w, x1, y1 - w], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return image


def random_image_example(rng: random.Random, size: int = 56):
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    return draw_shape(shape, colour, size, rng), f"a {colour} {shape}"


def image_chat(caption: str | None = None) -> list[dict]:
    """The chat of the image task; without ``caption``, the prompt only (generation prompt added by the caller)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": IMAGE_QUESTION}]}]
    if caption is not None:
        messages.append({"role": "assistant", "content": caption})
    return messages


__all__ = ["COLOURS", "IMAGE_QUESTION", "SHAPES", "captions", "draw_shape", "function_chats", "image_chat",
           "is_held_out", "random_image_example", "read_text", "split_files", "stdlib_files"]
