"""Fuzzing a live expert server (docs/fuzzing.md), the fuzzer's own oracle, and regressions for
what the fuzzer found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import CACHE, TEST_LOGS, open_log
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.connection import ServerConnection
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.protocol.control import JoinRequest, probe
from sglang_eaas.protocol.lines import AUTH_PREFIX
from sglang_eaas.protocol.header import MAGIC, RejectReason
from sglang_eaas.tools.fuzz.checks import final_checks
from sglang_eaas.tools.fuzz.control_cases import ControlCase, Line
from sglang_eaas.tools.fuzz.control_fuzzer import ControlTally, run_case
from sglang_eaas.tools.fuzz.good_client import GoodClientReport
from sglang_eaas.tools.fuzz.run import NO_ANSWER, FuzzConfig, run_fuzz
from sglang_eaas.tools.fuzz.slot_cases import (
    OK, Answer, SlotCase, SlotModel, SlotShape, expected_answer, pack_request, with_crc,
)
from sglang_eaas.tools.fuzz.slot_fuzzer import FuzzSlotClient, SlotTally

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]  # conftest's
SLOT_REASONS = {r.name for r in RejectReason} - {"NONE", "SERVER_ERROR"}
CONTROL_REASONS = {"unauthenticated", "line_too_long", "malformed", "unknown_op", "bad_field",
                   "out_of_order", "join_other_model", "join_other_weights",
                   "join_other_transport", "join_full"}


def test_fuzz_at_full_counts(tiny_qwen3):
    """10^5 slot cases and 10^4 malformed control messages against a live server: it stays up,
    serves the good client correctly throughout and counts every rejection exactly."""
    result = run_fuzz(FuzzConfig(tiny_qwen3, slot_cases=100_000, control_cases=10_000, seed=0,
                                 time_limit=300, log_dir=TEST_LOGS / "fuzz"),
                      progress=lambda _: None)
    failed = [f"{c.what}: {c.detail}" for c in result.checks if not c.passed]
    assert not failed, "\n".join(failed)
    assert result.complete, (result.slot.cases, result.control.refused_messages)
    # Every way to be wrong was exercised, and so were valid mutations and all restores.
    assert set(result.slot.expected) == SLOT_REASONS | {OK}
    assert set(result.control.expected) == CONTROL_REASONS
    assert set(result.slot.restores) >= {"stored EMPTY", "left, joined again",
                                         "left, joined again (slot written before ready)"}
    assert result.good.correct > 100


# -- the fuzzer's oracle, on hand-made headers ----------------------------------------------
SHAPE = SlotShape(max_tokens=8, hidden_size=64, top_k=2, dtype_code=0, moe_layers=(0, 1),
                  held=frozenset({0, 1, 2, 3}), num_experts=8)


def _header(**changes) -> bytes:
    fields = dict(magic=MAGIC, version=1, dtype=0, layer=1, tokens=2, top_k=2, hidden=64, seq=5,
                  payload=2 * (64 * 4 + 16))
    fields.update(changes)
    return pack_request(*fields.values())


@pytest.mark.parametrize("header, outcome", [
    (_header(), OK),
    (_header(magic=MAGIC ^ 1), "BAD_MAGIC"),
    (_header(version=2), "BAD_VERSION"),
    (_header()[:40] + b"\0\0\0\0" + bytes(20), "BAD_CHECKSUM"),
    (_header(dtype=3), "BAD_DTYPE"),
    (_header(seq=4), "STALE_SEQUENCE"),
    (_header(dtype=1), "BAD_SIZES"),  # a valid dtype code, not the slot's
    (_header(tokens=9, payload=9 * (64 * 4 + 16)), "BAD_SIZES"),  # over max_tokens
    (_header(tokens=0, payload=0), "BAD_SIZES"),
    (_header(payload=1), "BAD_SIZES"),
    (_header(layer=2), "UNKNOWN_LAYER"),
    (_header()[:63] + b"\1", OK),  # past the checksum: padding
])
def test_oracle_answers(header, outcome):
    model = SlotModel(SHAPE, last_seq=4)
    model.ids[:2] = [[0, -1], [3, 2]]
    answer = expected_answer(header, model)
    assert answer.outcome == outcome
    assert answer == (Answer(OK, 5, 2) if outcome == OK else
                      Answer(outcome, 5 if outcome in ("BAD_SIZES", "UNKNOWN_LAYER") else 4, 0))


def test_oracle_foreign_ids_and_recomputed_checksum():
    model = SlotModel(SHAPE)
    model.ids[:2] = [[0, 4], [-1, -1]]  # expert 4 is held elsewhere
    assert expected_answer(_header(seq=1), model).outcome == "FOREIGN_EXPERT"
    mutated = bytearray(_header(seq=2))
    mutated[8] = 7  # the layer id, under a checksum recomputed over it
    assert expected_answer(with_crc(bytes(mutated)), model).outcome == "UNKNOWN_LAYER"
    assert model.last_seq == 2


def test_checks_fail_on_a_miscount():
    """The verdict is not vacuous: one rejection the server did not count fails it."""
    slot, control = SlotTally(), ControlTally()
    slot.expected.update({"BAD_MAGIC": 1})
    good = GoodClientReport(requests=2, correct=2, sent_per_server=[1, 1], done_at=[1.0, 3.0])
    stats = [replace(NO_ANSWER, clients=0, refused_connections=0, control_refused={},
                     counters={"requests": 1}) for _ in range(2)]
    checks = {c.what: c.passed for c in final_checks(
        slot, control, good, stats, 1, [True, True], 0.0,
        {"slot fuzz": 2.0, "control fuzz": 2.0})}
    assert not checks["the fuzzed server counted every slot rejection, by reason, exactly"]
    stats[0] = replace(stats[0], counters={"requests": 1, "rejected_bad_magic": 1})
    checks = [c for c in final_checks(slot, control, good, stats, 1, [True, True], 0.0,
                                      {"slot fuzz": 2.0, "control fuzz": 2.0})]
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]


# -- regressions: what the fuzzer found -----------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_qwen3):
    log = open_log("fuzz-regressions")
    (local,) = start_local_servers(tiny_qwen3, [[0, 1, 2, 3]], "float32", 2,
                                   extra_args=("--max-tokens", "8"), stdout=log)
    yield local
    local.stop()
    log.close()


@pytest.mark.parametrize("flag", [0, 1, 2, 0x7F])
def test_a_slot_written_before_ready_is_handed_over_clean(server, tiny_qwen3, flag):
    """Found by fuzzing: a client that wrote its reserved slot's flag before 'ready' was refused
    ('internal error: slot flag holds ...') and left the slot poisoned for every later client
    offered it. The server now hands the slot over EMPTY whatever the flag held."""
    identity = ModelIdentity.of(tiny_qwen3)
    dirty = FuzzSlotClient(server.address, TOKEN, identity, "float32", "dirty", 8)
    try:
        dirty.leave()
        dirty.join(flag_before_ready=flag)  # raised TransportError before the fix
        model = dirty.model
        header = pack_request(MAGIC, 1, 0, 0, 1, 2, 64, model.last_seq + 1, 64 * 4 + 16)
        expected = dirty.write(SlotCase("valid", header, ids=[[0, 1]], weights=[[0.5, 0.5]]))
        dirty.region.notify(dirty.server_bell)
        assert expected.outcome == OK and dirty.answer(10) == expected
    finally:
        dirty.leave()
    ServerConnection(server.address, "next", identity, "float32", token=TOKEN).close()


def test_refusals_do_not_echo_unbounded_input(server, tiny_qwen3):
    """Found by fuzzing: a refusal repeated the refused value whole (a 1 MiB op made a reply
    over MAX_LINE, which no client reads in one line). Now it is one short sentence."""
    before = probe(server.address, TOKEN).control_refused
    identity = ModelIdentity.of(tiny_qwen3)
    request = JoinRequest("c", identity.fingerprint, "float32", "auto",
                          list(identity.expert_digests))
    join = {"op": request.op, **request.to_message()}
    huge = "x" * 500_000
    case = ControlCase("long values", (
        Line(AUTH_PREFIX + TOKEN.encode() + b"\n", None),
        Line(json.dumps({"op": huge}).encode() + b"\n", "unknown_op"),
        Line(json.dumps({**join, "transport": huge}).encode() + b"\n", "join_other_transport"),
        Line(json.dumps({**join, "dtype": huge}).encode() + b"\n", "bad_field"),
    ))
    assert run_case(_peer(server.address), case) == []  # each refusal <= MAX_REFUSAL bytes
    after = probe(server.address, TOKEN).control_refused
    for reason in ("unknown_op", "join_other_transport", "bad_field"):
        assert after[reason] == before.get(reason, 0) + 1


def test_a_slot_rejoined_under_a_stale_snapshot_is_read_as_the_new_clients(tiny_qwen3):
    """Found by fuzzing (1 case in 10^5): the serving loop walks a snapshot of the active slots;
    a client that left and a new one that joined the same index and published meanwhile had
    its request read through the old client's slot (its layout and sequence number). Here the
    leave, join and publish happen exactly between the snapshot and the loop's flag check."""
    import torch
    from ibgda import RegionHandle, create_transport
    from sglang_eaas.expert_server.server import ExpertServer, ExpertServerConfig
    from sglang_eaas.protocol.control import JoinRequest
    from sglang_eaas.protocol.slot import ClientSlot

    identity = ModelIdentity.of(tiny_qwen3)
    server = ExpertServer(ExpertServerConfig(str(tiny_qwen3), (0, 1, 2, 3), token=TOKEN,
                                             max_clients=1, max_tokens=8))

    def join(dtype: str):
        reply, member = server.join(JoinRequest("c", identity.fingerprint, dtype, "auto",
                                                 list(identity.expert_digests)))
        member.activate()
        return reply, member

    try:
        _, old_member = join("float32")
        old_slot, new = old_member.slot, {}
        real_ready = old_slot.ready

        def leave_join_publish() -> bool:  # control threads, while the loop holds its snapshot
            old_member.release()
            reply, _ = join("bfloat16")
            remote = create_transport("shm").connect(RegionHandle.from_dict(reply.region))
            new["client"] = ClientSlot(remote, reply.base, reply.layout, reply.bell,
                                       reply.first_seq)
            new["client"].send(0, torch.ones(2, 64), torch.tensor([[0, 1], [2, -1]]),
                               torch.full((2, 2), 0.5))
            old_slot.ready = real_ready
            return real_ready()

        old_slot.ready = leave_join_publish
        server.poll_once()  # the stale pass: must leave the new client's request alone
        server.poll_once()
        client = new["client"]
        assert client.wait(5)
        assert client.result().shape == (2, 64)  # rejected (BAD_SIZES) before the fix
        assert not any(k.startswith("rejected_") for k in server.stats)
    finally:
        server.close()


def _peer(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def test_fuzz_script_runs_and_reports(tmp_path):
    """The script: a short run passes, saves its report with the counts table, exits 0."""
    out = tmp_path / "fuzz.md"
    result = subprocess.run(
        [sys.executable, "scripts/fuzz.py", "--slot-cases", "300", "--control-cases", "100",
         "--seed", "7", "--time-limit", "120", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=CACHE.parent)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = out.read_text()
    assert "| slot: rejected BAD_MAGIC |" in report and "- FAIL" not in report
    assert "- command: `" in report  # the header: command, commit, date, machine
