"""The verdict of a fuzz run: each check one sentence, passed or not, with the numbers."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_eaas.protocol.control import ServerStats
from sglang_eaas.tools.fuzz.control_fuzzer import ControlTally
from sglang_eaas.tools.fuzz.good_client import GoodClientReport
from sglang_eaas.tools.fuzz.slot_cases import OK
from sglang_eaas.tools.fuzz.slot_fuzzer import SlotTally


@dataclass(frozen=True)
class Check:
    what: str
    passed: bool
    detail: str = ""


def server_rejections(stats: ServerStats) -> dict[str, int]:
    """``{"BAD_MAGIC": n, ...}`` from a server's ``rejected_<reason>`` counters."""
    return {k.removeprefix("rejected_").upper(): v for k, v in stats.counters.items()
            if k.startswith("rejected_") and v}


def final_checks(slot: SlotTally, control: ControlTally, good: GoodClientReport,
                 stats: list[ServerStats], clients_during: int, alive: list[bool],
                 started: float, phases: dict[str, float]) -> list[Check]:
    """``stats``: the fuzzed server's, then the helper's, once the good client has left."""
    fuzzed, helper = stats
    expected_rejected = {k: v for k, v in slot.expected.items() if k != OK and v}
    good_fuzzed, good_helper = (good.sent_per_server + [0, 0])[:2]
    slot_end = started + phases["slot fuzz"]
    control_end = slot_end + phases["control fuzz"]
    during_slot = sum(started <= t < slot_end for t in good.done_at)
    during_control = sum(slot_end <= t < control_end for t in good.done_at)
    checks = [
        Check("both expert servers are alive at the end", all(alive), f"alive: {alive}"),
        Check("every slot case was answered as expected (or, for a garbage flag, not at all)",
              not slot.problems and not slot.hung,
              f"{slot.wrong_answers} wrong answers; " + "; ".join(slot.problems[:3])),
        Check("the fuzzed server counted every slot rejection, by reason, exactly",
              server_rejections(fuzzed) == expected_rejected,
              f"server {server_rejections(fuzzed)}, fuzzer {expected_rejected}"),
        Check("the fuzzed server served exactly the accepted requests (fuzzers' and the good "
              "client's)", fuzzed.counter("requests") == slot.expected[OK] + good_fuzzed,
              f"server {fuzzed.counter('requests')}, fuzzers {slot.expected[OK]} + good client "
              f"{good_fuzzed}"),
        Check("no answer was dropped", not fuzzed.counter("answers_dropped"),
              f"answers_dropped {fuzzed.counter('answers_dropped')}"),
        Check("every control message got the reply expected",
              not control.problems and not control.hung,
              f"{control.wrong_replies} wrong replies; " + "; ".join(control.problems[:3])),
        Check("the fuzzed server counted every control refusal, by reason, exactly",
              fuzzed.control_refused == dict(control.expected),
              f"server {fuzzed.control_refused}, fuzzer {dict(control.expected)}"),
        Check("refused connections counted exactly",
              fuzzed.refused_connections == control.refused_connections,
              f"server {fuzzed.refused_connections}, fuzzer {control.refused_connections}"),
        Check("the good client got only correct results, in both phases",
              good.wrong == 0 and good.errors == 0 and during_slot > 0 and during_control > 0,
              f"{good.correct} correct, {good.wrong} wrong, {good.errors} failed "
              f"({during_slot} during the slot fuzz, {during_control} during the control "
              f"fuzz); {good.first_problem}"),
        Check("no slot leaked: only the good client held one after the fuzz, none after it left",
              clients_during == 1 and fuzzed.clients == 0 and helper.clients == 0,
              f"clients after the fuzz {clients_during}, at the end {fuzzed.clients} "
              f"(fuzzed) and {helper.clients} (helper)"),
        Check("the helper server saw only the good client's requests",
              not server_rejections(helper) and not helper.control_refused
              and helper.counter("requests") == good_helper,
              f"requests {helper.counter('requests')} (good client {good_helper}), rejected "
              f"{server_rejections(helper)}, refused {helper.control_refused}"),
    ]
    return checks
