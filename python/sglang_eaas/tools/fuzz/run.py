"""One fuzz run: two real expert servers on loopback, a well-behaved client, the fuzzers, checks.

The *fuzzed* server holds the first half of the experts, a *helper* server the rest; the good
client (``good_client``, its own process) uses both and checks every result against
transformers. The slot fuzz (``slot_fuzzer``) and then the control fuzz (``control_fuzzer``) run
against the fuzzed server while the good client keeps going. At the end every counter of the
fuzzed server must equal what the fuzzers expect, exactly (``checks``).
"""

from __future__ import annotations

import os
import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ibgda import TransportError
from sglang_eaas import envs
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.launcher.local_servers import LocalServer, die_with_parent, start_local_servers
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.protocol.control import ServerStats, probe
from sglang_eaas.tools.fuzz.checks import Check, final_checks
from sglang_eaas.tools.fuzz.control_cases import ControlCaseMaker, ControlTarget
from sglang_eaas.tools.fuzz.control_fuzzer import ControlTally, fill_every_slot, run_control_fuzz
from sglang_eaas.tools.fuzz.good_client import GoodClientProcess, GoodClientReport
from sglang_eaas.tools.fuzz.slot_fuzzer import FuzzSlotClient, SlotTally, run_slot_fuzz

SLOT_SHARE = 0.75  # of --time-limit for the slot fuzz, at most (the control fuzz has the rest)
DTYPES = ("float32", "bfloat16", "float16")  # the fuzzing clients' slot dtypes, in turn
READY_TIMEOUT = 300.0  # seconds for the good client to load its reference and join
SERVED_TIMEOUT = 30.0  # seconds a phase waits at its end for the good client's next result


@dataclass(frozen=True)
class FuzzConfig:
    model_path: Path
    slot_cases: int = 100_000
    control_cases: int = 10_000  # malformed control messages
    seed: int = 0
    time_limit: float = 600.0  # seconds for both fuzz phases together (setup not included)
    fuzz_clients: int = 6
    max_tokens: int = 8  # the servers' --max-tokens: small slots, requests over it are easy
    log_dir: Path = Path(".cache/logs/fuzz")


@dataclass
class FuzzResult:
    config: FuzzConfig
    slot: SlotTally
    control: ControlTally
    good: GoodClientReport
    stats: ServerStats  # the fuzzed server's, at the end
    checks: list[Check] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def complete(self) -> bool:
        """Both phases reached their counts (else the time limit stopped them)."""
        return (self.slot.cases >= self.config.slot_cases
                and self.control.refused_messages >= self.config.control_cases)


def split_experts(num_experts: int) -> tuple[list[int], list[int]]:
    """The fuzzed server's experts (the first half) and the helper's (the rest)."""
    half = max(1, num_experts // 2)
    return list(range(half)), list(range(half, num_experts))


def run_fuzz(config: FuzzConfig, progress: Callable[[str], None] = print) -> FuzzResult:
    """Start the servers and the good client, fuzz, check, stop everything."""
    if not envs.TOKEN.get():
        os.environ[envs.TOKEN.name] = secrets.token_hex(16)  # the children inherit it
    token = envs.TOKEN.get()
    info = MoeModelInfo.from_model_path(config.model_path)
    identity = ModelIdentity.of(config.model_path, info)
    fuzzed_experts, helper_experts = split_experts(info.num_experts)
    config.log_dir.mkdir(parents=True, exist_ok=True)
    log = open(config.log_dir / "processes.log", "w")
    good = GoodClientProcess(config.model_path, config.seed, log, preexec_fn=die_with_parent)
    max_clients = config.fuzz_clients + 2  # the good client and one control-fuzz join
    progress(f"starting 2 expert servers (experts {fuzzed_experts} fuzzed, {helper_experts} "
             f"helping) and the good client; logs in {config.log_dir}")
    servers: list[LocalServer] = []
    try:
        servers = start_local_servers(config.model_path, [fuzzed_experts, helper_experts],
                                      "float32", max_clients,
                                      extra_args=("--max-tokens", str(config.max_tokens)),
                                      stdout=log)
        good.start([s.address for s in servers], READY_TIMEOUT)
        return _fuzz(config, servers, good, token, identity, info.num_experts, max_clients,
                     frozenset(fuzzed_experts), progress)
    finally:
        good.kill()
        for server in servers:
            server.stop()
        log.close()


def _fuzz(config: FuzzConfig, servers: list[LocalServer], good: GoodClientProcess, token: str,
          identity: ModelIdentity, num_experts: int, max_clients: int, held: frozenset[int],
          progress: Callable[[str], None]) -> FuzzResult:
    fuzzed = servers[0].address
    started, served = time.monotonic(), good.done
    clients = [FuzzSlotClient(fuzzed, token, identity, DTYPES[i % len(DTYPES)], f"fuzz{i}",
                              num_experts) for i in range(config.fuzz_clients)]
    try:
        slot = run_slot_fuzz(clients, config.slot_cases,
                             started + SLOT_SHARE * config.time_limit, config.seed, progress)
        # A phase ends once the good client was served during it (a short run is shorter than
        # its pause and one request).
        good.served_since(served, SERVED_TIMEOUT)
    finally:
        for client in clients:
            client.leave()
    phases = {"slot fuzz": time.monotonic() - started}
    served = good.done
    progress(f"slot fuzz: {slot.cases} cases in {phases['slot fuzz']:.1f} s")
    target = ControlTarget(token, identity.fingerprint, identity.expert_digests, held)
    control = run_control_fuzz(fuzzed, target, config.control_cases,
                               started + config.time_limit, config.seed + 1, max_clients - 1,
                               progress)
    good.served_since(served, SERVED_TIMEOUT)
    phases["control fuzz"] = time.monotonic() - started - phases["slot fuzz"]
    progress(f"control fuzz: {control.refused_messages} bad messages over "
             f"{control.connections} connections in {phases['control fuzz']:.1f} s")
    clients_during = _stats(fuzzed, token).clients
    # One last fill: no reservation or slot leaked over the whole run.
    host, _, port = fuzzed.rpartition(":")
    try:
        fill_every_slot((host, int(port)), ControlCaseMaker(random.Random(0), target),
                        max_clients - 1, control)
    except OSError as exc:
        control.problem(f"filling every slot at the end: {exc}")
    try:
        report = good.stop()
    except RuntimeError as exc:
        report = GoodClientReport(errors=1, first_problem=str(exc))
    stats = [_settled(fuzzed, token, control), _stats(servers[1].address, token)]
    checks = final_checks(slot, control, report, stats, clients_during,
                          [s.process.poll() is None for s in servers], started, phases)
    return FuzzResult(config, slot, control, report, stats[0], checks, phases)


# What stands for the stats of a server that does not answer: no count it could have made
# (the checks then fail, with reasons).
NO_ANSWER = ServerStats(fingerprint="", pid=0, num_experts=0, weight_bytes=0, expert_digests={},
                        holdings=ServerHoldings(), adapter_paths={}, clients=-1, slots=-1,
                        expert_load={}, control_refused={"no answer": 1},
                        refused_connections=-1, counters={"requests": -1})


def _stats(address: str, token: str) -> ServerStats:
    """A server's stats; ``NO_ANSWER`` if it does not answer."""
    try:
        return probe(address, token)
    except TransportError:
        return NO_ANSWER


def _settled(address: str, token: str, control: ControlTally, timeout: float = 10.0) -> dict:
    """The server's stats once its control threads have counted every refusal (connections
    the fuzzer closed without waiting are counted by the server a little later)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(address, token)
        counted = sum(stats.control_refused.values())
        if counted >= sum(control.expected.values()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
