"""The test suite's own layout: no file in modeling_tests/ imports a test file or conftest.py. What tests share
(builders, checkpoint writers, independent references) lives in references.py; conftest.py holds fixtures only,
which pytest injects by name."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level module) of every import in the tree, function-level ones included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_no_file_imports_a_test_file_or_conftest():
    local_tests = {p.stem for p in TESTS.glob("test_*.py")} | {"conftest"}
    offenders = []
    for path in sorted(TESTS.glob("*.py")):
        for line, module in imported_names(ast.parse(path.read_text(), str(path))):
            if module in local_tests:
                offenders.append(f"{path.name}:{line} imports {module}")
    assert not offenders, "move what is shared into modeling_tests/references.py:\n" + "\n".join(offenders)


def test_the_walk_sees_every_kind_of_import():
    tree = ast.parse("import test_a\nfrom conftest import x\ndef f():\n    from test_b import y as z\n    import os.path\n")
    assert [m for _, m in imported_names(tree)] == ["test_a", "conftest", "test_b", "os"]
