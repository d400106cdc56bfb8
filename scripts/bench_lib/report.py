"""What every benchmark prints above its tables, and the file its report is saved to.

The header says how the numbers were made: the exact command line, the commit (``-dirty`` when
tracked files have uncommitted changes), the UTC date, the machine (cores, CPU model, load, the
CPU flags kernels depend on) and the torch/SGLang versions. ``Report`` prints the header and
the result sections as they come and saves them, together, to a markdown file the docs can
paste (progress lines are not saved).
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_DIR = ROOT / ".cache" / "bench"


def git_commit(root: Path = ROOT) -> str:
    """``git rev-parse --short HEAD``, plus ``-dirty`` when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git work tree)"
    return commit + ("-dirty" if dirty else "")


def _cpuinfo(field: str) -> str | None:
    """The first value of ``field`` in /proc/cpuinfo (Linux); None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    return _cpuinfo("model name") or platform.processor() or "unknown CPU"


# the instruction sets a CPU kernel's path depends on (the expert server's kernel, torch's GEMMs)
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16",
                "amx_tile")


def cpu_flags() -> str:
    """Which of ``KERNEL_FLAGS`` the CPU has, from /proc/cpuinfo (Linux; else 'unknown')."""
    flags = _cpuinfo("flags")
    if flags is None:
        return "unknown"
    have = set(flags.split())
    return " ".join(f for f in KERNEL_FLAGS if f in have) or "none of " + " ".join(KERNEL_FLAGS)


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def header_lines() -> list[str]:
    """The header, as markdown list items (one per line, so a terminal shows it as well)."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"- command: `{shlex.join(sys.orig_argv)}`",
        f"- commit: `{git_commit()}`; date: "
        f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {os.cpu_count()} cores ({cpu_model()}), load average at start {load} "
        f"(1, 5, 15 min); Python {platform.python_version()}, torch "
        f"{package_version('torch')}, sglang {package_version('sglang')}",
        f"- CPU flags: {cpu_flags()}",
    ]


def spread(values: list, fmt: str, suffix: str = "") -> str:
    """``median [min-max]`` of ``values`` (runs) in ``fmt``, ``suffix`` after the median (e.g.
    ``"x"``); the value alone for one run. A value of None (not seen in that run) is left out
    and counted: ``not seen`` when none was."""
    seen = [v for v in values if v is not None]
    missed = len(values) - len(seen)
    if not seen:
        return "not seen"
    text = format(statistics.median(seen), fmt) + suffix
    if len(seen) > 1:
        text += f" [{format(min(seen), fmt)}-{format(max(seen), fmt)}]"
    return text + (f" ({missed} not seen)" if missed else "")


def say(message: str, who: str = "bench") -> None:
    """A progress line on stdout, flushed at once (runs take minutes); not saved in the report."""
    print(f"{who}: {message}", flush=True)


def default_out(name: str) -> Path:
    """Where a script's report goes unless ``--out`` says otherwise: .cache/bench/NAME.md."""
    return DEFAULT_DIR / f"{name}.md"


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (and a line saying so) when
    matplotlib is not installed: a benchmark's plot is optional, its tables are not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("no plot: matplotlib is missing (pip install -e '.[bench]')")
        return None
    return plt


def save_figure(fig, path: Path, legend_below: int = 0) -> None:
    """A matplotlib figure to ``path`` (PNG), laid out; its parent made if missing. With
    ``legend_below`` > 0, the first chart's legend goes under all the charts, in that many
    columns (one legend for charts that share their lines)."""
    rect = None
    if legend_below:
        handles, labels = fig.axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=legend_below, fontsize=7,
                   frameon=False)
        rect = (0, 0.14, 1, 1)
    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    say(f"plot saved to {path}")


class Report:
    """The header and result sections of one run: printed at once, saved by ``save``."""

    def __init__(self, out: Path):
        self.out = out
        self.started = time.monotonic()
        self.sections: list[str] = []
        self.add("\n".join(header_lines()))

    def add(self, text: str) -> None:
        """A result section (a table, a verdict, a note): printed now, saved with the rest."""
        self.sections.append(text)
        print("\n" + text, flush=True)

    def save(self) -> Path:
        """Write every section (with the run time) to ``out``; returns its path."""
        self.add(f"Run time: {time.monotonic() - self.started:.0f} s.")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text("\n\n".join(self.sections) + "\n")
        print(f"\nreport saved to {self.out}", flush=True)
        return self.out
