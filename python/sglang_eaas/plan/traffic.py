"""The requests a simulation serves: arrival times and prompt and output lengths, from a Poisson
rate (constant or diurnal) with a length distribution, or from a trace file (JSON lines of
``{"arrival": SECONDS, "prompt": TOKENS, "output": TOKENS}``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sglang_eaas.plan.errors import PlanInputError

DISTRIBUTIONS = ("fixed", "exponential", "lognormal")


@dataclass(frozen=True)
class Traffic:
    arrival: np.ndarray  # [N] seconds, ascending
    prompt: np.ndarray  # [N] tokens >= 1
    output: np.ndarray  # [N] tokens >= 1
    source: str

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def duration(self) -> float:
        return float(self.arrival[-1]) if len(self) else 0.0


@dataclass(frozen=True)
class Lengths:
    """A length distribution: ``fixed`` (always the mean), ``exponential`` or ``lognormal`` with
    shape ``sigma``; at least 1, at most ``most`` tokens."""

    mean: int
    kind: str = "fixed"
    sigma: float = 1.0
    most: int = 1 << 17

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            out = np.full(n, float(self.mean))
        elif self.kind == "exponential":
            out = rng.exponential(self.mean, n)
        else:
            out = rng.lognormal(math.log(self.mean) - self.sigma ** 2 / 2, self.sigma, n)
        return np.clip(np.rint(out), 1, self.most).astype(np.int64)


def parse_lengths(flag: str, value: str, mean: int) -> Lengths:
    """``fixed``, ``exponential`` or ``lognormal[:SIGMA]`` for ``flag``."""
    kind, _, sigma = value.partition(":")
    if kind not in DISTRIBUTIONS or (sigma and kind != "lognormal"):
        raise PlanInputError(f"{flag} must be fixed, exponential or lognormal[:SIGMA], got "
                             f"{value!r}")
    try:
        shape = float(sigma) if sigma else 1.0
    except ValueError:
        shape = -1.0
    if not shape > 0 or mean < 1:
        raise PlanInputError(f"{flag}: the mean length must be >= 1 and SIGMA > 0, got mean "
                             f"{mean} and {value!r}")
    return Lengths(mean, kind, shape)


def poisson(rate: float, duration: float, prompt: Lengths, output: Lengths, seed: int = 0,
            diurnal: tuple[float, float] | None = None, trough_first: bool = False
            ) -> Traffic:
    """Poisson arrivals at ``rate`` requests/s over ``duration`` seconds; with ``diurnal`` =
    (amplitude, period seconds) the rate is ``rate * (1 + amplitude * sin(2 pi t / period))``
    (thinning), or with ``trough_first`` ``rate * (1 - amplitude * cos(2 pi t / period))``
    (the day starts at its lowest)."""
    if not rate > 0 or not duration > 0:
        raise PlanInputError(f"--traffic RATE and --duration must be > 0, got {rate:g} and "
                             f"{duration:g}")
    rng = np.random.default_rng(seed)
    peak = rate * (1 + (diurnal[0] if diurnal else 0.0))
    gaps = rng.exponential(1.0 / peak, int(peak * duration * 1.2) + 64)
    times = np.cumsum(gaps)
    while times[-1] < duration:
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1 / peak, 1024))])
    times = times[times < duration]
    if diurnal:
        amplitude, period = diurnal
        angle = 2 * np.pi * times / period
        wave = -np.cos(angle) if trough_first else np.sin(angle)
        keep = rng.random(len(times)) * peak < rate * (1 + amplitude * wave)
        times = times[keep]
    n = len(times)
    label = f"Poisson {rate:g}/s" + (f", diurnal +-{diurnal[0]:.0%}" if diurnal else "")
    return Traffic(times, prompt.draw(rng, n), output.draw(rng, n),
                   f"{label} for {duration:g}s, prompt {prompt.kind} {prompt.mean}, output "
                   f"{output.kind} {output.mean}")


def read_trace(path: str | Path) -> Traffic:
    """A trace file; ``PlanInputError`` naming the line of a bad record."""
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise PlanInputError(f"--traffic: cannot read {path} ({exc.strerror})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            row = (float(record["arrival"]), int(record["prompt"]), int(record["output"]))
        except (ValueError, KeyError, TypeError):
            raise PlanInputError(f"--traffic: {path}:{number} is not a record of arrival, "
                                 "prompt and output") from None
        if row[0] < 0 or row[1] < 1 or row[2] < 1:
            raise PlanInputError(f"--traffic: {path}:{number}: arrival must be >= 0 and the "
                                 "lengths >= 1")
        rows.append(row)
    if not rows:
        raise PlanInputError(f"--traffic: {path} holds no request")
    rows.sort()
    a, p, o = (np.array(c) for c in zip(*rows))
    return Traffic(a.astype(float), p.astype(np.int64), o.astype(np.int64), f"trace {path}")


def write_trace(path: str | Path, traffic: Traffic) -> None:
    with open(path, "w") as f:
        for a, p, o in zip(traffic.arrival, traffic.prompt, traffic.output):
            f.write(json.dumps({"arrival": round(float(a), 6), "prompt": int(p),
                                "output": int(o)}) + "\n")
