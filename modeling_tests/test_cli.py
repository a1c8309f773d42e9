"""``python -m transformers_k3``: help, option defaults and argument errors come before torch is imported (each run
under ``-X importtime``, whose log names every module the process imported), and errors are one line."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, code=None, timeout=120):
    """Run the CLI (or ``code`` that runs it) under -X importtime: (rc, stdout, stderr without the import log,
    the modules imported)."""
    command = [sys.executable, "-X", "importtime"] + (["-c", code] if code else ["-m", "transformers_k3"]) + list(args)
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    imported, other = set(), []
    for line in result.stderr.splitlines():
        match = re.match(r"import time:\s+[\d\s|]+\|\s+(\S+)$", line)
        if match:
            imported.add(match.group(1).strip())
        elif not line.startswith("import time:"):
            other.append(line)
    return result.returncode, result.stdout, "\n".join(other), imported


def _options(help_text: str) -> dict[str, str]:
    """Each option's help entry (``--name``: its text), from an argparse help screen."""
    entries, name = {}, None
    for line in help_text.splitlines():
        match = re.match(r"  (-\w, )?(--[\w-]+)", line)
        if match:
            name = match.group(2)
            entries[name] = line
        elif name and line.startswith("   "):
            entries[name] += " " + line.strip()
        else:
            name = None
    return entries


@pytest.mark.parametrize("command", [(), ("generate",), ("serve",), ("demo",)])
def test_help_prints_every_default_before_torch(command):
    rc, out, err, imported = _run(*command, "--help")
    assert rc == 0, err
    assert "torch" not in imported and "transformers" not in imported, sorted(m for m in imported if "torch" in m)
    options = _options(out)
    assert options and all(name == "--help" or "(default:" in text for name, text in options.items()), options
    if command == ("generate",):
        assert "most tokens to generate (default: 64)" in " ".join(out.split())
    if command == ("serve",):
        assert "(default: 127.0.0.1)" in out and "(default: 8000)" in out


@pytest.mark.parametrize("args,rc,message", [
    (("generate", "x", "--bogus"), 2, "python -m transformers_k3 generate: error: unrecognized arguments: --bogus"),
    (("generate",), 2, "python -m transformers_k3 generate: error: give a prompt"),
    (("generate", "x", "--thinking", "--no-thinking"), 2, "--thinking and --no-thinking exclude each other"),
    (("demo", "--model", "/nonexistent"), 2, "python -m transformers_k3 demo: error: --model /nonexistent does not "
                                               "exist"),
    (("serve", "/nonexistent"), 2, "python -m transformers_k3 serve: error: /nonexistent does not exist"),
    (("serve", "--port", "70000"), 2, "--port must be 0-65535"),
    (("serve", "--chat-template-kwargs", "[1]"), 2, "--chat-template-kwargs must be a JSON object"),
])
def test_argument_errors_are_one_line_before_torch(args, rc, message):
    code, out, err, imported = _run(*args)
    assert code == rc, err
    assert "torch" not in imported, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err
    # the subcommand's own usage, not the top-level one
    assert err.startswith(f"usage: python -m transformers_k3 {args[0]} "), err


def test_image_without_pillow_names_the_vision_extra(tmp_path):
    """A base install (Pillow absent: hidden from the import system here) gets one line saying what to install."""
    image = tmp_path / "a.png"
    image.write_bytes(b"\x89PNG")
    code = ("import runpy, sys; sys.modules['PIL'] = None; sys.argv = ['transformers_k3'] + sys.argv[1:]; "
            "runpy.run_module('transformers_k3', run_name='__main__')")
    rc, out, err, imported = _run("generate", "--image", str(image), "hi", code=code)
    assert rc == 1, err
    assert err.strip() == '--image needs Pillow, which the base install leaves out: pip install "transformers-k3[vision]"'
