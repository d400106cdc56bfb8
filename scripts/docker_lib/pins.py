"""The versions this repository pins, read from where they are defined (never a second copy):
the package's version and its SGLang pin from setup.py, torch's from scripts/setup.sh."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup_keywords() -> dict[str, object]:
    """The literal keyword arguments of setup.py's ``setup(...)`` call."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    (call,) = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "id", None) == "setup"]
    found = {}
    for keyword in call.keywords:
        try:
            found[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            continue  # not a literal (e.g. a find_packages() call)
    return found


def package_version() -> str:
    """sglang-eaas's own version (setup.py ``version``), the images' tag prefix."""
    return _setup_keywords()["version"]


def sglang_version() -> str:
    """The SGLang release the plugin is pinned to (setup.py's ``gpu`` extra, ``sglang==X``)."""
    (pin,) = [r for r in _setup_keywords()["extras_require"]["gpu"] if r.startswith("sglang==")]
    return pin.removeprefix("sglang==")


def torch_version() -> str:
    """The torch release scripts/setup.sh installs on a machine with no GPU."""
    setup_sh = (ROOT / "scripts" / "setup.sh").read_text()
    (version,) = re.findall(r'pip_install [^\n]*"torch==([^"]+)"', setup_sh)
    return version


def python_requires() -> tuple[int, int]:
    """The oldest Python the package installs on (setup.py ``python_requires=">=X.Y"``)."""
    major, minor = _setup_keywords()["python_requires"].removeprefix(">=").split(".")
    return int(major), int(minor)
