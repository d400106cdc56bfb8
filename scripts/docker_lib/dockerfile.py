"""The images' Dockerfiles (docker/Dockerfile.gpu, docker/Dockerfile.cpu) as data, parsed by
dockerfile-parse: their steps, base image, COPYs and default command; and the build context
they see, the repository less what .dockerignore leaves out."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"gpu": ROOT / "docker" / "Dockerfile.gpu", "cpu": ROOT / "docker" / "Dockerfile.cpu"}
IMAGE = "sglang-eaas"  # the repository name both images are pushed under, tagged VERSION-KIND


class Step(NamedTuple):
    instruction: str  # upper case: FROM, RUN, COPY, ...
    value: str  # its arguments, continuation lines joined
    line: int  # 1-based, where it starts


class Copy(NamedTuple):
    sources: tuple[str, ...]  # relative to the build context (the repository root)
    dest: str
    flags: tuple[str, ...]  # --chown=..., --from=...


@dataclass(frozen=True)
class Dockerfile:
    path: Path
    base: str  # the FROM image, its build args at their defaults
    steps: tuple[Step, ...]  # comments left out

    def of(self, instruction: str) -> list[Step]:
        return [s for s in self.steps if s.instruction == instruction]

    @cached_property
    def arg_defaults(self) -> dict[str, str]:
        """Every ``ARG NAME=default`` (global or in the stage)."""
        return dict(s.value.split("=", 1) for s in self.of("ARG") if "=" in s.value)

    def copies(self) -> list[Copy]:
        found = []
        for step in self.of("COPY"):
            assert not step.value.startswith("["), f"{self.path.name}:{step.line}: JSON COPY"
            words = shlex.split(step.value)
            flags = tuple(w for w in words if w.startswith("--"))
            paths = [w for w in words if not w.startswith("--")]
            found.append(Copy(tuple(paths[:-1]), paths[-1], flags))
        return found

    def cmd(self) -> list[str]:
        """The default command (exec form)."""
        (step,) = self.of("CMD")
        return json.loads(step.value)


def read(path: Path) -> Dockerfile:
    with path.open("rb") as text:  # a path not named Dockerfile is taken for a folder
        parser = DockerfileParser(fileobj=text, env_replace=False)
        steps = tuple(Step(s["instruction"], s["value"], s["startline"] + 1)
                      for s in parser.structure if s["instruction"] != "COMMENT")
        return Dockerfile(path, parser.baseimage, steps)


def ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regular expression (``**`` any folders, ``*`` and ``?``
    within one path element)."""
    parts = re.split(r"(\*\*/?|\*|\?)", pattern.strip("/"))
    table = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(table.get(p, re.escape(p)) for p in parts))


def in_context(relpath: str) -> bool:
    """Whether ``relpath`` (from the repository root) is sent to the builder: the last
    .dockerignore pattern matching it or a folder above it decides (``!`` keeps it)."""
    parts = Path(relpath).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    kept = True
    for pattern in ignore_patterns():
        keep = pattern.startswith("!")
        regex = _pattern(pattern.removeprefix("!"))
        if any(regex.fullmatch(p) for p in prefixes):
            kept = keep
    return kept
