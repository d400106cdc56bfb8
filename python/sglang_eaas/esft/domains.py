"""The text domains ESFT adapters of ``models/tiny-moe-stdlib`` are trained on.

Each domain is text that a stock Debian machine with CPython already has (nothing is downloaded)
and that the base model did not see: it was trained on the stdlib's ``*.py`` sources *without*
their test directories (``sglang_eaas.corpus``). Files are listed in sorted order, split by
file exactly as the base model's corpus was (held out when ``crc32(relative path) % 20 == 0``),
then each split is put in a fixed pseudo-random order (by another CRC of the path) and read up
to a size of text, so a capped split is a sample of the whole domain rather than its first
directories.
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sglang_eaas.corpus import HELD_OUT_MOD, SKIP_DIRS, is_held_out, read_text, stdlib_root

_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


class DomainError(ValueError):
    """A domain that is unknown or has no files on this machine."""


@dataclass(frozen=True)
class Domain:
    """Where a domain's files are: ``globs`` under ``root()``, regular files only (symlinks,
    which are aliases of other files there, are left out), kept when ``keep(relative path)``;
    of each file at most its first ``max_file_chars`` characters are used (0: all)."""

    name: str
    description: str
    root: Callable[[], Path]
    globs: tuple[str, ...]
    keep: Callable[[str], bool] = lambda rel: True
    gzipped: bool = False
    max_file_chars: int = 0

    def where(self) -> str:
        return ", ".join(str(self.root() / g) for g in self.globs)


def _stdlib_test_source(rel: str) -> bool:
    """A ``*.py`` under a stdlib test directory, outside third-party packages and caches."""
    parts = rel.split("/")[:-1]
    return (any(p in _TEST_DIRS for p in parts)
            and not any(p in SKIP_DIRS - _TEST_DIRS or p.startswith("config-") for p in parts))


DOMAINS: dict[str, Domain] = {d.name: d for d in (
    Domain("pytests",
           "CPython's own test suites: *.py under the stdlib's test/, tests/ and idle_test/ "
           "directories (the base model's corpus skipped them)",
           stdlib_root, ("**/*.py",), keep=_stdlib_test_source),
    # Section 1 is left out: on this machine's image nearly all of it (16631 of 17849 pages)
    # is one generated command reference (gcloud), which would make the domain one tool's
    # boilerplate.
    Domain("manpages",
           "roff sources of the English manual pages in sections 2-8 (system calls, library "
           "functions, file formats, overviews, administration), gunzipped",
           lambda: Path("/usr/share/man"), tuple(f"man{s}/*.gz" for s in range(2, 9)),
           gzipped=True),
    # A few packages' changelogs are megabytes long: their newest 16000 characters each, so
    # that a capped split still holds many packages.
    Domain("changelogs",
           "Debian package changelogs (/usr/share/doc/*/changelog.Debian.gz, dpkg's "
           "changelog format), gunzipped, the newest 16000 characters of each",
           lambda: Path("/usr/share/doc"), ("*/changelog.Debian.gz",), gzipped=True,
           max_file_chars=16000),
)}


def get_domain(name: str) -> Domain:
    if name not in DOMAINS:
        raise DomainError(f"unknown domain {name!r}; the domains are {', '.join(DOMAINS)}")
    return DOMAINS[name]


def domain_files(domain: Domain) -> list[str]:
    """Relative paths (posix, sorted) of the domain's files; ``DomainError`` if there are none."""
    root = domain.root()
    found = set()
    for pattern in domain.globs:
        for path in root.glob(pattern):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and not path.is_symlink() and domain.keep(rel):
                found.add(rel)
    if not found:
        raise DomainError(f"domain {domain.name!r} has no files on this machine "
                          f"(looked for {domain.where()})")
    return sorted(found)


def _sample_order(rel: str) -> int:
    return zlib.crc32(b"esft-sample:" + rel.encode())


@dataclass(frozen=True)
class DomainSplit:
    """One split of a domain as read: file paths (relative to the domain's root) and texts."""

    files: tuple[str, ...]
    texts: tuple[str, ...]

    @property
    def chars(self) -> int:
        return sum(len(t) for t in self.texts)


def split_domain(domain: Domain, max_train_mb: float) -> tuple[DomainSplit, DomainSplit]:
    """(train, held-out): the base model's rule (``is_held_out``), each split in sample order
    and, with ``max_train_mb`` > 0, read until it holds that many million characters (the
    held-out one a twentieth of it; always at least one file); ``DomainError`` when either split
    is empty."""
    files = domain_files(domain)
    train = sorted((f for f in files if not is_held_out(f)), key=_sample_order)
    held = sorted((f for f in files if is_held_out(f)), key=_sample_order)
    if not train or not held:
        raise DomainError(f"domain {domain.name!r} has too few files on this machine to hold "
                          f"some out ({len(files)} under {domain.where()})")
    limit = max_train_mb * 1e6 if max_train_mb > 0 else float("inf")
    return _read(domain, train, limit), _read(domain, held, limit / HELD_OUT_MOD)


def _read(domain: Domain, files: list[str], limit: float) -> DomainSplit:
    taken, texts, total = [], [], 0
    for rel in files:
        if taken and total >= limit:
            break
        text = read_domain_text(domain, rel)
        taken.append(rel)
        texts.append(text)
        total += len(text)
    return DomainSplit(tuple(taken), tuple(texts))


def read_domain_text(domain: Domain, rel: str) -> str:
    if domain.gzipped:
        data = gzip.decompress((domain.root() / rel).read_bytes())
        text = data.decode("utf-8", errors="replace")
    else:
        text = read_text(domain.root(), rel)
    return text[:domain.max_file_chars] if domain.max_file_chars else text
