"""Comments and docstrings say why; measurements live in bench/RESULTS.md (issue 45, "Prose where it belongs").

The pattern is the one of the 2026-12-07 architecture review (§2.8: `N ms|us|µs|ns`, `Nx`, `measured`, `GFLOP`),
widened to seconds, rates and "N times faster", and tightened so shapes, hex, byte sizes and accuracy ratios pass.

Deliberately not flagged (each case is in `test_the_pattern_passes_plain_text`):
- string literals other than docstrings: error messages are behaviour, not prose;
- shapes and counts ("2x2", "4 x 64 x 64", "16 tokens", "64K multiply-adds", "2 MB"): no time unit, no speed;
- scientific notation, versions, formulas ("1e-5", "torch 2.13", "sech^2 s"): the number is glued to an operator;
- count and accuracy ratios ("2x more value heads", "~3x less accurate", modeling_kimi_k3.py's MLA): not a speed;
- "measured" without a number ("the op's measured crossover", modeling_kimi_k3.py's KDA): a reason, not a measurement;
- dates: the review's regex counted them, but a date is not a timing (there are none today).
"""

import ast
import io
import pathlib
import re
import tokenize

import pytest


PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "transformers_k3"

# A number not glued to a word, a number or an operator on its left ("fp32", "1e-5", "x^2 s" are not quantities).
_NUM = r"(?<![\w.\-^*/])~?[0-9][0-9.,]*(?:\s?[-–/]\s?~?[0-9][0-9.,]*)*"
_TIMING = re.compile(
    "|".join(
        [
            # a duration: "35 us", "1.2 ms", "~10 us", "2.5-4 s", "ms/token"
            rf"{_NUM}\s?(?:ms|us|µs|ns|s|sec|secs|seconds?|milliseconds?|microseconds?|nanoseconds?|minutes?|min)\b",
            # a speed ratio written "2.5x" / "~100x" (not "2x2", "0x1f", "4 x 64": the x must end the word)
            rf"{_NUM}x\b(?!\s+(?:more|fewer|less|larger|smaller|wider|narrower|bigger)\s+(?!time|faster|slower|calls?\b))",
            # "3 times faster", "two times slower"
            r"\b(?:[0-9][0-9.,]*|two|three|four|five|ten)\s+times\s+(?:faster|slower|quicker|as fast|as slow)\b",
            # a percentage with a speed word on the same line: "13 % faster", "+7-13 % on the forward ... faster"
            rf"{_NUM}\s?%.*\b(?:faster|slower|quicker|speed-?up)\b",
            rf"\b(?:faster|slower|quicker|speed-?up)\b.*{_NUM}\s?%",
            # a rate: "tokens/s", "12 GFLOP/s"
            r"\b(?:tokens?|tok|it|samples?|steps?|GFLOPS?|TFLOPS?|GB|MB)\s?/\s?s\b",
            r"GFLOP",
            # a measurement as such: "measured: ...", "Measured on ...", with a number on the line
            rf"\b[Mm]easured\b.*{_NUM}",
        ]
    )
)


def _python_prose(path):
    """(line number, text) of every comment and every docstring line of a Python file."""
    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                for offset, line in enumerate(ast.get_source_segment(source, first).splitlines()):
                    yield first.lineno + offset, line


def _cpp_prose(path):
    """(line number, text) of every // and /* */ comment line of a C++ file (skipping string and char literals)."""
    text = path.read_text(encoding="utf-8")
    i, line, n = 0, 1, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            yield line, text[i:end]
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            for offset, part in enumerate(text[i:end].split("\n")):
                yield line + offset, part
            line += text.count("\n", i, end)
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            i += 1


def _offending_lines():
    found = []
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix == ".py":
            prose = _python_prose(path)
        elif path.suffix in (".cpp", ".h"):
            prose = _cpp_prose(path)
        else:
            continue
        for number, text in prose:
            if _TIMING.search(text):
                found.append(f"{path.relative_to(PACKAGE)}:{number}: {text.strip()}")
    return found


def test_no_comment_or_docstring_quotes_a_timing():
    found = _offending_lines()
    assert not found, (
        f"{len(found)} comment/docstring lines quote a timing or speed ratio; keep the one-line reason in the "
        "source and move the numbers to bench/RESULTS.md:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "text",
    [
        "# ~35 us per call",
        "# 1.2 ms (H=4) / 3.4 ms (H=32)",
        "# 2.5-4x faster than the PyTorch code",
        "# ~100x slower as subnormal floats",
        "# 3 times faster",
        "# 12 GFLOP/s",
        "# 40 tokens/s",
        "# took 119 s to compile",
        "# measured +7-13 % on the forward, slower",
        "// 0.86-0.99x the time",
        "# measured: 101 vs 263",
    ],
)
def test_the_pattern_flags_timings(text):
    assert _TIMING.search(text)


@pytest.mark.parametrize(
    "text",
    [
        "# [2, 2] x [2, 2] and a 2x2 tile",  # shapes
        "# 0x1F mask",  # hex
        "# 4 x 64 x 64 bmm",  # a shape with spaces
        "# eps 1e-5, values ~1e-40",  # scientific notation
        "# bf16 / fp32 / float16 rows",  # dtype names
        "# needs torch 2.13 and transformers 5.25",  # versions
        "# 64K multiply-adds, 2 MB buffers, 8 bytes",  # sizes
        "# 2x more value heads",  # a count ratio, not a speed
        "# ~3x less accurate than the prefill",  # an accuracy ratio, not a speed
        "# the op's measured crossover",  # a reason, no number
        "# 16 tokens per chunk, 4 rows",  # counts
        "// sech^2 s + beta tanh s (1 - s)",  # a formula whose variable is s
    ],
)
def test_the_pattern_passes_plain_text(text):
    assert not _TIMING.search(text)
