"""README.md's "What a GPU host skips" names exactly the tests marked `cpu_only`: the modules
whose module-level ``pytestmark`` holds ``pytest.mark.cpu_only``, and ``module.py::name`` for
each function or class decorated with it. Found by parsing test/*.py with ``ast`` (no pytest
run), so a mark inside a string (test_markers.py's inner suite) does not count; a mark added at
collection time by a hook would not be seen."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TEST_DIR = Path(__file__).resolve().parent
README = TEST_DIR.parent / "README.md"
SECTION = "## What a GPU host skips"
NAME = re.compile(r"`(test_\w+\.py(?:::\w+)?)`")


def _is_cpu_only(node: ast.expr) -> bool:
    """``pytest.mark.cpu_only`` or ``mark.cpu_only``, called or not."""
    if isinstance(node, ast.Call):
        node = node.func
    if not (isinstance(node, ast.Attribute) and node.attr == "cpu_only"):
        return False
    base = node.value
    return (isinstance(base, ast.Attribute) and base.attr == "mark") or (
        isinstance(base, ast.Name) and base.id == "mark")


def cpu_only_marks(source: str, module: str) -> set[str]:
    """``module`` if its ``pytestmark`` holds the mark, plus ``module::name`` for each marked
    top-level function or class (and method of a top-level class)."""
    found = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
                value = node.value
                marks = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
                if any(_is_cpu_only(m) for m in marks):
                    found.add(module)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if any(_is_cpu_only(d) for d in node.decorator_list):
                found.add(f"{module}::{node.name}")
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                            and any(_is_cpu_only(d) for d in item.decorator_list)):
                        found.add(f"{module}::{node.name}::{item.name}")
    return found


def suite_cpu_only() -> set[str]:
    found = set()
    for path in sorted(TEST_DIR.glob("*.py")):
        found |= cpu_only_marks(path.read_text(), path.name)
    return found


def readme_section() -> str:
    text = README.read_text()
    assert SECTION in text, f"README.md has no '{SECTION}' section"
    section = text.split(SECTION, 1)[1]
    return section.split("\n## ", 1)[0]


def test_the_parser_finds_module_and_single_marks_only_in_code():
    source = '''
import pytest
from pytest import mark

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]

@pytest.mark.cpu_only
def test_a():
    pass

@mark.cpu_only
class TestB:
    @pytest.mark.cpu_only()
    def test_c(self):
        pass

@pytest.mark.gpu
def test_d():
    pass

INNER = """
@pytest.mark.cpu_only
def test_in_a_string():
    pass
"""
'''
    assert cpu_only_marks(source, "m.py") == {"m.py", "m.py::test_a", "m.py::TestB",
                                              "m.py::TestB::test_c"}
    assert cpu_only_marks("pytestmark = pytest.mark.slow\n", "n.py") == set()


def test_readme_names_exactly_the_cpu_only_tests():
    marked = suite_cpu_only()
    assert marked, "no cpu_only test found in test/: the parser or the markers changed"
    named = set(NAME.findall(readme_section()))
    assert named == marked, (
        f"README.md's '{SECTION}' lists {sorted(named - marked)} that are not cpu_only and "
        f"misses {sorted(marked - named)}")
