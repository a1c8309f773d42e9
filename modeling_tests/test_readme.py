"""The README as a new user meets it: every Python snippet runs as pasted, the two set-up commands are the ones
`.ci/run` runs, and every file it links exists."""

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)
SERVER_URL = "http://localhost:8000/v1"


def _snippet_id(code: str) -> str:
    return next(line for line in code.splitlines() if line and not line.startswith(("import", "from"))) [:40]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})


@pytest.fixture(scope="module")
def server_port():
    """`python -m transformers_k3 serve` on a free loopback port, as the README starts it (the shipped model)."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.25"):
        pytest.skip("serve plugs into the server classes of transformers 5.25")
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "transformers_k3", "serve", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"the server exited: {process.stdout.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("the server did not answer within 300 s")
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def test_the_readme_has_its_snippets():
    assert len(SNIPPETS) >= 5
    assert sum(SERVER_URL in code for code in SNIPPETS) == 1


@pytest.mark.parametrize("code", [c for c in SNIPPETS if SERVER_URL not in c], ids=_snippet_id)
def test_python_snippet_runs_as_pasted(code, tmp_path):
    result = _run(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "a README snippet should show the user something"


def test_server_snippet_runs_against_the_served_model(server_port, tmp_path):
    (code,) = [c for c in SNIPPETS if SERVER_URL in c]
    # (the only change: the port this test's server listens on)
    result = _run(code.replace("localhost:8000", f"127.0.0.1:{server_port}"), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()


def _readme_command(name: str) -> str:
    match = re.search(rf"<!-- ci: {name} -->\s*```bash\n(.*?)\n```", README, re.S)
    assert match, f"README.md has no bash block after '<!-- ci: {name} -->'"
    return match.group(1).strip()


def test_the_two_commands_are_what_ci_runs():
    first, tests = _readme_command("first"), _readme_command("tests")
    assert "python -m transformers_k3 generate" in first and "[test]" not in first and "[dev]" not in first
    assert "python -m pytest modeling_tests" in tests and '".[test]"' in tests
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line.removesuffix(" || exit 1") for line in ci_lines
                if line and not line.startswith("#") and "pip install" in line]
    assert commands == [first, tests]


def test_links_point_at_files_that_exist():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target
    for doc in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists() or (ROOT / target).exists(), (doc.name, target)


def test_no_timings_in_the_readme():
    """Measurements live in bench/RESULTS.md: the README body quotes none (they go stale and differ by machine)."""
    assert not re.search(r"\d\s*(ms|us|µs|seconds|minutes|tokens/s|tok/s)\b|\d+(\.\d+)?x faster", README)


def test_architecture_names_files_that_exist():
    """docs/ARCHITECTURE.md walks the network through the package's files: every path it names exists."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`([\w/]+\.(?:py|cpp|h))`", text))
    assert len(named) >= 20
    missing = [name for name in named if not (ROOT / "src" / "transformers_k3" / name).exists()]
    assert not missing, missing
    assert "docs/ARCHITECTURE.md" in README
