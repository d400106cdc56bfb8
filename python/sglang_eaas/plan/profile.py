"""A hardware profile (``PROFILE.yaml``): what one device and the fabric between devices can do,
and what a device costs. Shipped: ``profiles/h100.yaml`` and ``h200.yaml`` (published
specifications), ``cpu-here.yaml`` (this machine, fitted by ``scripts/bench_plan_calibrate.py``).

Format (every number positive; ``source`` says where each block's numbers come from)::

    name: h100
    device:
      memory_bandwidth: 3.35e12     # bytes/s
      flops: {bfloat16: 9.89e14, float32: 6.7e13}   # dense FLOP/s per dtype
      memory: 8.0e10                # bytes
      roofline: max                 # max: memory and compute overlap (a GPU); sum: one after
                                    #   the other (a CPU core); default max
      expert_rows:                  # optional, measured: an expert's seconds per byte of its
        rows: [1, 2, 4, 8]          #   weights when it computes exactly k rows (interpolated;
        seconds_per_byte: [...]     #   in proportion to k past the last); an expert with a
                                    #   mean of n entries costs the mean over a Poisson count
                                    #   of mean n; replaces the roofline there
      source: "..."
    fabric:
      intra_node: {bandwidth: 4.5e11, message_s: 2.0e-6, source: "..."}  # bytes/s, s/message
      inter_node: {bandwidth: 5.0e10, message_s: 4.0e-6, source: "..."}
      serial_messages: false        # true: an endpoint pays each message's fixed cost in
                                    #   turn (a CPU thread); false: once (all in flight)
      call_s: 0                     # seconds an endpoint works per dispatch or combine
                                    #   outside its messages (a CPU client's routing and
                                    #   sums); default 0
      entry_s: 0                    # seconds an endpoint works per (token, expert) entry of
                                    #   a phase outside its messages; default 0
    gpus_per_node: 8
    host_cores: 2                   # the devices of a node are processes sharing this many
                                    #   cores (a CPU host); omitted: each device is its own
    price_per_gpu_hour: 2.5
    price_source: "..."
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from sglang_eaas.plan.errors import PlanInputError

PROFILES = Path(__file__).with_name("profiles")
POISSON_UP_TO = 64.0  # mean rows per expert up to which a measured curve is Poisson-averaged


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction, one endpoint
    message_s: float  # fixed cost of one message, seconds

    def message(self, nbytes: float) -> float:
        """Seconds one message of ``nbytes`` takes on this link."""
        return self.message_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Device:
    memory_bandwidth: float  # bytes/s
    flops: Mapping[str, float]  # dtype -> dense FLOP/s
    memory: float  # bytes
    serial: bool = False  # memory and compute one after the other (``roofline: sum``)
    rows: tuple[tuple[int, float], ...] = ()  # measured (rows of an expert, s per byte)

    def seconds_per_byte_at_rows(self, k: np.ndarray) -> np.ndarray:
        """The ``rows`` curve at exactly ``k`` rows (k >= 1): the cost of k rows, over the
        expert's bytes, interpolated between its points, in proportion to k below the first
        and past the last."""
        xs, ys = (np.array(v, dtype=float) for v in zip(*self.rows))
        k = np.asarray(k, dtype=float)
        return np.where(k < xs[0], ys[0] * k / xs[0],
                        np.where(k > xs[-1], ys[-1] * k / xs[-1], np.interp(k, xs, ys)))

    def expert_seconds_per_byte(self, n: np.ndarray) -> np.ndarray:
        """An expert's mean seconds per byte at a mean of ``n`` entries: the ``rows`` curve
        averaged over a Poisson count of mean ``n`` (0 rows: nothing to do). The routing's
        counts vary from step to step and a kernel's cost is not linear in them (a CPU kernel
        changes its inner loop with the rows it multiplies together), so a mean count alone
        does not give the mean cost."""
        n = np.asarray(n, dtype=float)
        small = np.where(n < POISSON_UP_TO, n, 0.0)  # past it the count is about its mean
        top = float(small.max(initial=0.0))
        k = np.arange(1, int(np.ceil(top + 10 * np.sqrt(top) + 10)) + 1, dtype=float)
        log_factorial = np.cumsum(np.log(k))
        safe = np.where(small > 0, small, 1.0)[..., None]
        pmf = np.exp(k * np.log(safe) - safe - log_factorial)
        averaged = (pmf * self.seconds_per_byte_at_rows(k)).sum(axis=-1)
        return np.where(n >= POISSON_UP_TO, self.seconds_per_byte_at_rows(np.maximum(n, 1.0)),
                        np.where(n > 0, averaged, 0.0))

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s for ``dtype`` (float16 reads bfloat16's where only that is given)."""
        for name in (dtype, "bfloat16" if dtype == "float16" else dtype):
            if name in self.flops:
                return self.flops[name]
        raise PlanInputError(f"the profile gives no FLOP/s for {dtype} (device.flops has "
                             f"{', '.join(self.flops)})")

    def roofline(self, nbytes: float, flops: float, dtype: str) -> float:
        """Seconds of work that reads ``nbytes`` and computes ``flops``: the slower of the two
        (``serial``: both, one after the other)."""
        memory, compute = nbytes / self.memory_bandwidth, flops / self.peak(dtype)
        return memory + compute if self.serial else max(memory, compute)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    device: Device
    intra_node: Link
    inter_node: Link
    gpus_per_node: int
    price_per_gpu_hour: float
    sources: Mapping[str, str]  # block -> where its numbers come from
    serial_messages: bool = False  # an endpoint pays each message's fixed cost in turn
    call_s: float = 0.0  # an endpoint's own work per dispatch or combine, outside messages
    entry_s: float = 0.0  # an endpoint's own work per entry of a phase, outside messages
    host_cores: int | None = None  # the cores a node's devices share (None: their own)

    def link(self, node_a: int, node_b: int) -> Link:
        return self.intra_node if node_a == node_b else self.inter_node


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile file, or the name of a shipped one (``h100``); ``PlanInputError`` in one
    sentence for anything else."""
    import yaml

    path = Path(path)
    if not path.suffix and (PROFILES / f"{path}.yaml").is_file():
        path = PROFILES / f"{path}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        shipped = ", ".join(sorted(p.stem for p in PROFILES.glob("*.yaml")))
        raise PlanInputError(f"--hardware: cannot read {path} ({exc.strerror}); give a profile "
                             f"file or one of {shipped}") from None
    except yaml.YAMLError:
        raise PlanInputError(f"--hardware: {path} is not valid YAML") from None
    return parse_profile(data, str(path))


def parse_profile(data: Any, where: str = "<profile>") -> HardwareProfile:
    top = _mapping(where, data)
    device = _mapping(f"{where}: device", top.get("device"))
    flops = _mapping(f"{where}: device.flops", device.get("flops"))
    roofline = device.get("roofline", "max")
    if roofline not in ("max", "sum"):
        raise PlanInputError(f"{where}: device.roofline must be max or sum, got {roofline!r}")
    made = Device(_positive(where, "device.memory_bandwidth", device.get("memory_bandwidth")),
                  {str(k): _positive(where, f"device.flops.{k}", v) for k, v in flops.items()},
                  _positive(where, "device.memory", device.get("memory")), roofline == "sum",
                  _rows(where, device.get("expert_rows")))
    fabric = _mapping(f"{where}: fabric", top.get("fabric"))
    links = {}
    for name in ("intra_node", "inter_node"):
        link = _mapping(f"{where}: fabric.{name}", fabric.get(name))
        links[name] = Link(_positive(where, f"fabric.{name}.bandwidth", link.get("bandwidth")),
                           _positive(where, f"fabric.{name}.message_s", link.get("message_s")))
    gpus = top.get("gpus_per_node")
    if type(gpus) is not int or gpus < 1:
        raise PlanInputError(f"{where}: gpus_per_node must be a positive integer, got {gpus!r}")
    cores = top.get("host_cores")
    if cores is not None and (type(cores) is not int or cores < 1):
        raise PlanInputError(f"{where}: host_cores must be a positive integer, got {cores!r}")
    sources = {"device": str(device.get("source", "not stated")),
               **{name: str(_mapping("", fabric[name]).get("source", "not stated"))
                  for name in links},
               "price": str(top.get("price_source", "not stated"))}
    return HardwareProfile(
        str(top.get("name", Path(where).stem)),
        made, links["intra_node"], links["inter_node"], gpus,
        _positive(where, "price_per_gpu_hour", top.get("price_per_gpu_hour")), sources,
        _flag(where, "fabric.serial_messages", fabric.get("serial_messages", False)),
        _positive(where, "fabric.call_s", fabric["call_s"]) if fabric.get("call_s") else 0.0,
        _positive(where, "fabric.entry_s", fabric["entry_s"]) if fabric.get("entry_s") else 0.0,
        cores)


def _rows(where: str, value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    curve = _mapping(f"{where}: device.expert_rows", value)
    xs, ys = curve.get("rows"), curve.get("seconds_per_byte")
    if not isinstance(xs, list) or not isinstance(ys, list) or len(xs) != len(ys) \
            or len(xs) < 2:
        raise PlanInputError(f"{where}: device.expert_rows needs lists rows and "
                             "seconds_per_byte of the same length, at least 2")
    if any(type(x) is not int or x < 1 for x in xs) or any(b <= a for a, b in zip(xs, xs[1:])):
        raise PlanInputError(f"{where}: device.expert_rows.rows must be increasing positive "
                             f"integers, got {xs!r}")
    ys = [_positive(where, "device.expert_rows.seconds_per_byte", y) for y in ys]
    return tuple(zip(xs, ys))



def _flag(where: str, field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise PlanInputError(f"{where}: {field} must be true or false, got {value!r}")
    return value


def _mapping(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise PlanInputError(f"{where} must be a mapping, got {value!r:.40}")
    return value


def _positive(where: str, field: str, value: Any) -> float:
    if isinstance(value, str):  # YAML 1.1 reads 4.5e11 (no sign in the exponent) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanInputError(f"{where}: {field} must be a positive number, got {value!r}")
    return float(value)
