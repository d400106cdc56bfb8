"""The test files that hold tests marked ``gpu``, against the files scripts/gpu_check.sh runs them
from, so a new GPU test cannot be left out of the GPU run unnoticed. Files are parsed with
``ast`` (as test/test_readme_gpu_skips.py does): a mark inside a string, such as the inner suites
of test_markers.py, does not count.

    python -m gpu_lib.selection FILE...   # exit 1, naming the difference, unless FILE... are
                                          # exactly test/'s files with a gpu mark
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

TEST_DIR = Path(__file__).resolve().parents[2] / "test"


def _is_gpu_mark(node: ast.AST) -> bool:
    """``pytest.mark.gpu`` or ``mark.gpu``, anywhere in the code."""
    if not (isinstance(node, ast.Attribute) and node.attr == "gpu"):
        return False
    base = node.value
    return (isinstance(base, ast.Attribute) and base.attr == "mark") or (
        isinstance(base, ast.Name) and base.id == "mark")


def files_with_gpu_tests(test_dir: Path = TEST_DIR) -> set[str]:
    """``test/NAME.py`` for every test module with a ``gpu`` mark in its code."""
    return {f"test/{path.name}" for path in sorted(test_dir.glob("test_*.py"))
            if any(_is_gpu_mark(node) for node in ast.walk(ast.parse(path.read_text())))}


def main(argv: list[str]) -> int:
    marked, named = files_with_gpu_tests(), set(argv)
    if marked == named:
        print(f"selection: the gpu tests live in exactly the {len(marked)} files run: "
              f"{' '.join(sorted(marked))}")
        return 0
    print(f"selection: files with gpu tests that gpu_check.sh does not run: "
          f"{sorted(marked - named)}; files it runs with no gpu test: {sorted(named - marked)} "
          "(update GPU_MARKED_FILES in scripts/gpu_check.sh)")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
