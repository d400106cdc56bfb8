"""Fuzzing clients: each joins an expert server as any client does, then writes random and
mutated requests into its own slot, publishes them and checks every answer (``slot_cases``).

The clients go in rounds: each publishes one case, one ring wakes the server, then each waits
for its answer, so the server sees several slots ready at once. A client that stored a garbage
flag is not answered; it sits the next round out (the server polls its slot meanwhile: another
client's answer in that round comes from a poll that started after the garbage was stored),
then restores its slot by storing EMPTY or by leaving and joining again. One rejoin in four
first writes garbage into the reserved slot, before ``ready``.
"""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ibgda import RegionHandle, TransportError, create_transport
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.protocol.control import JoinRequest, Ready, ReleaseSlots
from sglang_eaas.protocol.lines import Channel
from sglang_eaas.protocol.header import HEADER_BYTES
from sglang_eaas.tools.fuzz.slot_cases import (
    CLIENT_WRITE_DONE, DTYPE_BYTES, Answer, CaseMaker, SlotCase, SlotModel, SlotShape,
    expected_answer, parse_result,
)

SERVER_DONE, EMPTY = 2, 0
ANSWER_TIMEOUT = 30.0  # seconds: a server that takes longer is reported as hung
MAX_PROBLEMS = 20  # wrong answers kept for the report (all are counted)
SPIN = 2e-3  # seconds a client busy-polls for its answer before sleeping on its doorbell


@dataclass
class SlotTally:
    """What the slot fuzz did and what the server must have counted."""

    cases: int = 0
    by_kind: collections.Counter = field(default_factory=collections.Counter)
    expected: collections.Counter = field(default_factory=collections.Counter)  # outcome -> n
    restores: collections.Counter = field(default_factory=collections.Counter)
    wrong_answers: int = 0
    problems: list[str] = field(default_factory=list)
    hung: bool = False

    def problem(self, text: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)


class FuzzSlotClient:
    """One joined slot written raw through this process's mapping of the server's region."""

    def __init__(self, address: str, token: str, identity: ModelIdentity, dtype: str,
                 name: str, num_experts: int):
        self.address, self.token, self.identity = address, token, identity
        self.dtype, self.name, self.num_experts = dtype, name, num_experts
        self.channel = self.region = None
        self.spin = SPIN
        self.sitting_out = 0
        self.garbage: int | None = None  # a garbage flag value stored: restore before reuse
        self.dead = False  # could not join again: out of the run (reported)
        self.join()

    def join(self, flag_before_ready: int | None = None) -> None:
        """Join in two steps; ``flag_before_ready``: a value stored into the reserved slot's
        flag before ``ready`` (what a misbehaving client may do)."""
        self.channel = Channel(self.address, self.token)
        try:
            reply = self.channel.call(JoinRequest(self.name, self.identity.fingerprint,
                                                  self.dtype, "shm",
                                                  list(self.identity.expert_digests)))
            handle = RegionHandle.from_dict(reply.region)
            self.region = create_transport(handle.backend).connect(handle)
            layout, base = reply.layout, reply.base
            if flag_before_ready is not None:
                self.region.store_flag(base + layout.flag, flag_before_ready)
            self.channel.call(Ready())
        except BaseException:
            self.close()
            raise
        self.flag, self.bell, self.server_bell = base + layout.flag, base + layout.bell, reply.bell
        self.model = SlotModel(SlotShape(
            layout.max_tokens, layout.hidden_size, layout.top_k, int(layout.dtype),
            tuple(reply.moe_layers), frozenset(reply.holdings.experts()), self.num_experts),
            last_seq=getattr(reply, "first_seq", 0))  # the join's sequence base, where given
        slot = self.region.mapped(base, layout.size).numpy()

        def section(offset: int, nbytes: int) -> np.ndarray:
            return slot[offset : offset + nbytes]

        rows, k = layout.max_tokens, layout.top_k
        self.ids = section(layout.expert_ids, rows * k * 4).view(np.int32).reshape(rows, k)
        self.weights = section(layout.router_weights, rows * k * 4).view(np.float32)
        self.weights = self.weights.reshape(rows, k)
        self.hidden = memoryview(section(
            layout.hidden, rows * layout.hidden_size * DTYPE_BYTES[int(layout.dtype)]))
        self.request_header = memoryview(section(layout.request_header, HEADER_BYTES))
        self.result_header = memoryview(section(layout.result_header, HEADER_BYTES))
        self.ids[:] = self.model.ids  # the mirror starts true: every id -1

    def write(self, case: SlotCase) -> Answer | None:
        """Write ``case`` and store its flag; the answer the server owes (None: no answer)."""
        if case.ids is not None:
            self.ids[: len(case.ids)] = case.ids
            self.model.ids[: len(case.ids)] = case.ids
        if case.weights is not None:
            self.weights[: len(case.weights)] = case.weights
        if case.hidden is not None:
            self.hidden[: len(case.hidden)] = case.hidden
        self.request_header[:] = case.header
        expected = None
        if case.flag == CLIENT_WRITE_DONE:
            expected = expected_answer(case.header, self.model)
        self.region.store_flag(self.flag, case.flag)
        self.garbage = None if case.flag == CLIENT_WRITE_DONE else case.flag
        return expected

    def answer(self, timeout: float) -> Answer | str | None:
        """The server's answer (or why it is not one); None if none came within ``timeout``."""
        if not self.region.wait_flag(self.flag, SERVER_DONE, timeout, self.bell, self.spin):
            return None
        return parse_result(bytes(self.result_header))

    def restore(self, rng: random.Random, tally: SlotTally) -> None:
        """Make the slot usable again after a garbage flag (or an exhausted sequence)."""
        if self.garbage is not None and self.region.load_flag(self.flag) != self.garbage:
            tally.problem(f"{self.name}: the server moved a slot holding the garbage flag "
                          f"{self.garbage} to {self.region.load_flag(self.flag)}")
        how = rng.random()
        if how < 0.5 and not self.model.exhausted:
            self.region.store_flag(self.flag, EMPTY)
            tally.restores["stored EMPTY"] += 1
        else:
            dirty = how > 0.875
            self.leave()
            try:
                self.join(flag_before_ready=rng.choice([0, 1, 2, 0x7F, 0xFF]) if dirty else None)
                tally.restores["left, joined again" + (" (slot written before ready)"
                                                      if dirty else "")] += 1
            except TransportError as exc:
                tally.problem(f"{self.name}: joining again "
                              f"{'after writing the reserved slot ' if dirty else ''}failed: "
                              f"{exc}")
                try:
                    self.join()  # a clean join must work whatever happened before
                except TransportError as again:
                    tally.problem(f"{self.name}: a clean join failed after that: {again}")
                    self.dead = True
        self.garbage = None

    def leave(self) -> None:
        """Leave and wait for the server to take the slot back (a server gone needs none)."""
        try:
            if self.channel is not None:
                self.channel.call(ReleaseSlots())
        except TransportError:
            pass  # the server is gone: the final checks say so
        finally:
            self.close()

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
            self.region = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def run_slot_fuzz(clients: list[FuzzSlotClient], cases: int, deadline: float, seed: int,
                  progress: Callable[[str], None] = lambda _: None,
                  garbage_flag_rate: float = 0.01) -> SlotTally:
    """Run ``cases`` cases over ``clients`` (or until ``time.monotonic() >= deadline``)."""
    rng = random.Random(seed)
    maker, tally = CaseMaker(rng, garbage_flag_rate), SlotTally()
    next_report = time.monotonic() + 5
    while tally.cases < cases and time.monotonic() < deadline and not tally.hung:
        published: list[tuple[FuzzSlotClient, SlotCase, Answer]] = []
        for client in clients:
            if client.dead:
                continue
            if client.sitting_out:
                client.sitting_out -= 1
                continue
            if client.garbage is not None or client.model.exhausted:
                client.restore(rng, tally)
            case = maker.make(client.model)
            tally.cases += 1
            tally.by_kind[case.kind] += 1
            expected = client.write(case)
            if expected is None:
                client.sitting_out = 1
            else:
                published.append((client, case, expected))
            if tally.cases >= cases:
                break
        if published:
            published[0][0].region.notify(published[0][0].server_bell)
        for client, case, expected in published:
            got = client.answer(ANSWER_TIMEOUT)
            if got is None:
                tally.hung = True
                tally.problem(f"{client.name}: no answer within {ANSWER_TIMEOUT:.0f} s to a "
                              f"'{case.kind}' case (header {case.header.hex()})")
                break
            tally.expected[expected.outcome] += 1
            if got != expected:
                tally.wrong_answers += 1
                tally.problem(f"{client.name}: a '{case.kind}' case (header "
                              f"{case.header.hex()}) was answered {got}, expected {expected}")
        if time.monotonic() > next_report:
            next_report += 5
            progress(f"slot cases: {tally.cases} of {cases}, {sum(tally.restores.values())} "
                     f"restores, {tally.wrong_answers} wrong answers")
    for client in clients:
        if client.garbage is not None:
            tally.restores["left with a garbage flag"] += 1
    return tally
