"""The text this project trains on: the running interpreter's own standard library sources.

Every CPython installation has them, so training needs no download: ``*.py`` under
``sysconfig.get_paths()["stdlib"]``, without tests, encodings tables, site-packages and the
machine-specific ``_sysconfigdata*``, in sorted order; a fixed 1 in ``HELD_OUT_MOD`` of them (by a
CRC of the relative path) is held out for evaluation. Used by the tiny-model trainer
(``tools/train_tiny_moe.py``), ESFT's training domains (``esft/domains.py``,
``esft/finetune.py``) and the load traces (``balance/traces.py``).
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

# Skipped anywhere in a relative path: tests, third-party packages, caches, binary-ish tables.
SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings",
    "lib-dynload", "__phello__",
})
HELD_OUT_MOD = 20  # a file is held out when crc32(relative path) % 20 == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[str]:
    """Relative paths (posix, sorted) of the stdlib sources used as the corpus."""
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata") or not path.is_file():
            continue
        paths.append(rel.as_posix())
    return sorted(paths)


def is_held_out(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % HELD_OUT_MOD == 0


def split_corpus(root: Path, max_mb: float) -> tuple[list[str], list[str]]:
    """(train, held-out) file lists; with ``max_mb`` > 0 each is cut (in order) near that size
    (the held-out one near a twentieth of it), keeping at least one file each."""
    files = corpus_files(root)
    train = [f for f in files if not is_held_out(f)]
    held = [f for f in files if is_held_out(f)]
    if not train or not held:
        raise ValueError(f"no Python sources found under {root} to train on")
    if max_mb > 0:
        train = _cut(root, train, max_mb * 1e6)
        held = _cut(root, held, max_mb * 1e6 / HELD_OUT_MOD)
    return train, held


def _cut(root: Path, files: list[str], limit: float) -> list[str]:
    out, total = [], 0
    for rel in files:
        if out and total >= limit:
            break
        out.append(rel)
        total += (root / rel).stat().st_size
    return out


def read_text(root: Path, rel: str) -> str:
    return (root / rel).read_text(encoding="utf-8", errors="replace")
