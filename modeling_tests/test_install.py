"""What the tests import is what the README's test command installs.

Every third-party module a test file imports (or asks for with `pytest.importorskip`) must be importable here and
come from a distribution that `pip install -e ".[test]"` brings in: the package's requirements, its `test` extra,
and what those require in turn. A package installed by hand on a developer's machine (or CI's) therefore fails
this test instead of hiding a missing install step, and a test cannot silently skip for lack of a package the
README promises."""

import ast
import importlib.metadata as metadata
import importlib.util
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

TESTS = Path(__file__).resolve().parent
LOCAL = {p.stem for p in TESTS.glob("*.py")} | {"transformers_k3"}


def imported_modules() -> dict[str, set[str]]:
    """top-level module -> the test files that import it (plain imports and importorskip)."""
    found: dict[str, set[str]] = {}
    for path in TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                names = [node.args[0].value]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in LOCAL:
                    found.setdefault(top, set()).add(path.name)
    return found


def installed_by_the_test_command() -> set[str]:
    """Distributions `pip install -e ".[test]"` installs: transformers-k3[test] and its requirements' closure."""
    seen: set[str] = set()
    todo = [("transformers-k3", frozenset({"test"}))]
    done = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in done:
            continue
        done.add((name, extras))
        seen.add(canonicalize_name(name))
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requirements:
            requirement = Requirement(text)
            environments = [{"extra": extra} for extra in extras] or [{"extra": ""}]
            if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments):
                todo.append((requirement.name, frozenset(requirement.extras)))
    return seen


def test_every_module_the_tests_import_is_installed_by_the_test_command():
    distributions = metadata.packages_distributions()
    allowed = installed_by_the_test_command()
    assert "pytest" in allowed and "torch" in allowed, "transformers-k3 is not installed with its metadata"
    problems = []
    for module, files in sorted(imported_modules().items()):
        owners = {canonicalize_name(d) for d in distributions.get(module, [])}
        if importlib.util.find_spec(module) is None:
            problems.append(f"{module} (imported by {sorted(files)}) is not installed")
        elif not owners & allowed:
            problems.append(f"{module} (imported by {sorted(files)}) comes from {sorted(owners) or 'nowhere known'}, "
                            "which the README's test command does not install: add it to the `test` extra")
    assert not problems, "\n".join(problems)


def test_the_scan_sees_the_test_suites_imports():
    modules = imported_modules()
    assert {"torch", "transformers", "pytest"} <= set(modules)
    assert re.match(r"^[a-z_]", next(iter(modules)))
