"""scripts/setup.sh: clear refusals on an unfit machine, and nothing to do on a second run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

SETUP = Path(__file__).resolve().parent.parent / "scripts" / "setup.sh"


def _run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash"), str(SETUP)], env=env, capture_output=True,
                          text=True, timeout=120)


def test_second_run_has_nothing_to_do():
    """The suite runs inside the venv setup.sh made: running it again only checks the stamp."""
    result = _run({**os.environ, "SGLANG_EAAS_VENV": sys.prefix})
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"setup: {re.escape(sys.prefix)} is up to date \((cpu|gpu)\)",
                        result.stdout.strip())


def test_old_python_is_refused(tmp_path):
    fake = tmp_path / "python3.9"
    fake.write_text('#!/bin/sh\ncase "$1" in -V) echo "Python 3.9.18";; *) exit 1;; esac\n')
    fake.chmod(0o755)
    result = _run({**os.environ, "PYTHON": str(fake), "SGLANG_EAAS_VENV": str(tmp_path / "v")})
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"setup: error: Python >= 3.10 is required, '{fake}' is Python 3.9.18; "
        "set PYTHON=/path/to/python3.10+"
    )
    assert not (tmp_path / "v").exists()


def test_missing_compiler_is_refused(tmp_path):
    bin_dir = tmp_path / "bin"  # a PATH with Python and the basic tools, but no cc/gcc
    bin_dir.mkdir()
    for tool in ("dirname", "cat", "sha256sum", "cut"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "python3").symlink_to(sys.executable)
    result = _run({"PATH": str(bin_dir), "HOME": str(tmp_path),
                   "SGLANG_EAAS_VENV": str(tmp_path / "v")})
    assert result.returncode == 1
    assert "setup: error: no C compiler found" in result.stderr
    assert not (tmp_path / "v").exists()
