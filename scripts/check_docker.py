"""Check the images' Dockerfiles without Docker (docs/deployment.md, "Images"): hadolint on both,
then the CPU image's RUN steps run by its SHELL, in order, in a scratch copy of what its COPYs
copy, with its WORKDIR, ENV and build arguments, as this machine's user and with HOME in the
scratch folder, so the venv they make there is a clean one (pip keeps this machine's settings:
where it finds packages).

    python scripts/check_docker.py [--lint-only] [--dry-run] [--root-steps]
                                   [--build-arg NAME=VALUE ...] [--scratch DIR] [--keep]

The steps the image runs as root (apt-get, useradd) change a machine: they are listed, not run,
unless --root-steps (a throwaway machine). This machine's Python and Debian stand for the base
image's. Where PyTorch's index is out of reach and pip finds torch's CPU build locally (the
project's machines), pass --build-arg TORCH_INDEX=. A full run takes what a fresh
scripts/setup.sh takes (about 3 minutes on 2 cores) plus SGLang's --help. Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docker_lib import dockerfile, hadolint

ROOT = dockerfile.ROOT
ROOT_USERS = ("root", "0", "0:0", "root:root")


class StepFailed(RuntimeError):
    pass


def lint() -> bool:
    paths = list(dockerfile.DOCKERFILES.values())
    done = hadolint.lint(paths)
    print(done.stdout + done.stderr, end="")
    names = ", ".join(str(p.relative_to(ROOT)) for p in paths)
    print(f"check_docker: hadolint on {names}: {'clean' if done.returncode == 0 else 'FAILED'}")
    return done.returncode == 0


def expand(text: str, values: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` replaced as Docker does in ENV and WORKDIR (unset: empty)."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), ""), text)


def pip_settings() -> dict[str, str]:
    """This machine's pip settings (its ``PIP_*`` variables, and its user's pip.conf, which a
    HOME in the scratch folder would hide): where pip finds packages stands for the network the
    image is built on (on the project's machines, torch's CPU build is found only through them)."""
    settings = {name: value for name, value in os.environ.items() if name.startswith("PIP_")}
    if "PIP_CONFIG_FILE" not in settings:
        home = Path.home()
        for config in (home / ".config" / "pip" / "pip.conf", home / ".pip" / "pip.conf"):
            if config.is_file():
                settings["PIP_CONFIG_FILE"] = str(config)
                break
    return settings


class Image:
    """The image's filesystem laid out under ``rootfs``: absolute paths the Dockerfile names
    (its WORKDIRs) are taken there."""

    def __init__(self, rootfs: Path, build_args: dict[str, str]):
        self.rootfs = rootfs
        self.cwd = rootfs
        self.env = {"PATH": os.environ["PATH"], "HOME": str(rootfs / "home"), "LANG": "C.UTF-8",
                    **pip_settings()}
        self.build_args = build_args
        self.declared: dict[str, str] = {}  # the stage's ARGs, which RUN sees as variables
        self.shell = ["/bin/sh", "-c"]
        self.as_root = True
        self.mapped: list[str] = []
        (rootfs / "home").mkdir(parents=True, exist_ok=True)

    def map(self, text: str) -> str:
        for prefix in sorted(self.mapped, key=len, reverse=True):
            text = re.sub(rf"(?<![\w/.-]){re.escape(prefix)}(?![\w.-])",
                          str(self.rootfs) + prefix, text)
        return text

    def workdir(self, path: str) -> None:
        path = expand(path, {**self.env, **self.declared})
        if path.startswith("/"):
            self.mapped.append(path)
            self.cwd = self.rootfs / path.lstrip("/")
        else:
            self.cwd = self.cwd / path
        self.cwd.mkdir(parents=True, exist_ok=True)

    def copy(self, copy: dockerfile.Copy) -> None:
        dest = self.cwd / copy.dest
        for source in copy.sources:
            src = ROOT / source
            if src.is_dir():
                shutil.copytree(src, dest, dirs_exist_ok=True, symlinks=True,
                                ignore=self._left_out)
            else:
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / src.name)

    @staticmethod
    def _left_out(folder: str, names: list[str]) -> list[str]:
        relative = Path(folder).relative_to(ROOT)
        return [n for n in names if not dockerfile.in_context(str(relative / n))]

    def run(self, command: str, dry_run: bool) -> None:
        command = self.map(command)
        env = {**self.env, **self.declared}
        if dry_run:
            print(f"    would run in {self.cwd}: {shlex.join([*self.shell, command])}")
            return
        started = time.monotonic()
        done = subprocess.run([*self.shell, command], cwd=self.cwd, env=env)
        if done.returncode != 0:
            raise StepFailed(f"exit {done.returncode} after {time.monotonic() - started:.0f} s")
        print(f"    ok ({time.monotonic() - started:.0f} s)")


def run_steps(path: Path, image: Image, dry_run: bool, root_steps: bool) -> None:
    parsed = dockerfile.read(path)
    copies = iter(parsed.copies())  # one per COPY step, in order
    for step in parsed.steps:
        where = f"{path.name}:{step.line} {step.instruction}"
        value = step.value
        if step.instruction == "ARG":
            name, _, default = value.partition("=")
            image.declared[name] = image.build_args.get(name, default)
        elif step.instruction == "ENV":
            for pair in shlex.split(value):
                name, _, raw = pair.partition("=")
                image.env[name] = image.map(expand(raw, {**image.env, **image.declared}))
        elif step.instruction == "SHELL":
            image.shell = json.loads(value)
        elif step.instruction == "WORKDIR":
            image.workdir(value)
        elif step.instruction == "USER":
            image.as_root = value in ROOT_USERS
        elif step.instruction == "COPY":
            image.copy(next(copies))
        elif step.instruction == "RUN":
            if image.as_root and not root_steps:
                print(f"{where}: not run (as root in the image; --root-steps): {value}")
                continue
            print(f"{where}: {value}", flush=True)
            image.run(value, dry_run)
            continue
        print(f"{where} {value}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/check_docker.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--lint-only", action="store_true", help="hadolint only")
    parser.add_argument("--dry-run", action="store_true",
                        help="lay out the scratch copy and print each RUN step, run none")
    parser.add_argument("--root-steps", action="store_true",
                        help="run the image's root steps too (apt-get, useradd: a throwaway "
                        "machine only)")
    parser.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="as docker build's (e.g. TORCH_INDEX= here)")
    parser.add_argument("--scratch", type=Path, default=None,
                        help="the scratch folder (default: a new one under $TMPDIR)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the scratch folder after a passing run (a failed one is kept)")
    args = parser.parse_args(argv)
    for pair in args.build_arg:
        if "=" not in pair:
            parser.error(f"--build-arg {pair!r}: expected NAME=VALUE")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not lint():
        return 1
    if args.lint_only:
        return 0
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="check-docker-"))
    build_args = dict(pair.split("=", 1) for pair in args.build_arg)
    print(f"check_docker: the CPU image's steps in {scratch}")
    started = time.monotonic()
    try:
        run_steps(dockerfile.DOCKERFILES["cpu"], Image(scratch / "rootfs", build_args),
                  args.dry_run, args.root_steps)
    except StepFailed as exc:
        print(f"check_docker: error: that step failed ({exc}); the scratch copy is kept in "
              f"{scratch}", file=sys.stderr)
        return 1
    print(f"check_docker: the CPU image's steps {'laid out' if args.dry_run else 'passed'} "
          f"in {time.monotonic() - started:.0f} s")
    if not (args.keep or args.scratch):
        shutil.rmtree(scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
