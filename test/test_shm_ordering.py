"""Publish ordering on the ``shm`` backend between real processes, under load.

The test process (the reader) creates one region; WRITERS writer processes (more than the
machine's cores, on purpose) each own one slot-like area of it: a flag line (flag byte at 0, the
writer's doorbell u32 at 4) and a PAYLOAD-byte payload spanning a thousand cache lines. Per round
a writer waits for its flag to be 0 (handed back), then ``put_signal``s a payload whose every
int64 word encodes (writer, round, word index) and release-stores the round's tag into the flag.
The reader acquire-loads the flags and checks every payload a published flag vouches for: it
must be whole and from that round and writer, neither torn (a mix of rounds) nor stale (the
last round) nor foreign; then it hands the slot back (flag 0) and rings the writer's bell.

What this proves, and what it does not: the host side of the publish rule (``put_signal``'s
copy is complete when the flag is stored, the flag is stored after it, the reader checks after
its acquire load) between separate processes with real preemption. On x86-64, where this runs,
the hardware does not reorder stores with stores nor loads with loads, so it does not exercise
the release/acquire of ``ibgda/csrc/host_atomics.c`` against a weakly ordered CPU (on aarch64
the same test would; it has not run on one); device memory ordering is a GPU question
(docs/ibgda.md).

The checker is shown to catch tearing twice: on hand-made torn, stale and foreign payloads
(deterministic), and on writers that store the flag *before* the payload, run until caught
(here within a second, in some hundred rounds; the run allows 10 s).

    python test_shm_ordering.py HANDLE_JSON WRITER ROUNDS MODE   # one writer; MODE: ordered |
                                                                 # flag-first (the broken one)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

import ibgda

# No hardware marker: shm between host processes runs on CPU and GPU hosts alike.

WRITERS = 6  # processes writing at once, on purpose more than the 2 cores of the dev machine
ROUNDS = 4000  # per writer: 24,000 published payloads checked in all
PAYLOAD = 64 << 10  # bytes per payload: 1024 cache lines
LINE = 64
READER_BELL = 0  # the reader's doorbell (u32), rung by writers after they publish
SLOT = LINE + PAYLOAD
WORDS = PAYLOAD // 8
ROUND_SHIFT, WRITER_SHIFT = 20, 48  # word = writer << 48 | round << 20 | index (index < 2**13)
SPIN = 1e-3  # seconds the reader polls (yielding) before it sleeps on its bell
WAIT_TIMEOUT = 60.0  # a writer waiting longer for its slot gives up (the reader has stopped)
INDEX = torch.arange(WORDS, dtype=torch.int64)
BROKEN_PIECES = 16  # writes per payload of the broken writer: a window of tens of microseconds


def flag_offset(writer: int) -> int:
    return LINE + writer * SLOT


def writer_bell(writer: int) -> int:
    return flag_offset(writer) + 4


def payload_offset(writer: int) -> int:
    return flag_offset(writer) + LINE


def region_bytes(writers: int) -> int:
    return LINE + writers * SLOT


def round_tag(round_: int) -> int:
    """The flag byte that publishes round ``round_`` (>= 1); 0 means handed back."""
    return (round_ - 1) % 255 + 1


def pattern(writer: int, round_: int) -> torch.Tensor:
    """The payload of (writer, round): int64 ``[WORDS]``, every word distinct and telling."""
    return INDEX + ((writer << WRITER_SHIFT) | (round_ << ROUND_SHIFT))


def check_payload(payload: torch.Tensor, writer: int, round_: int) -> str | None:
    """None if ``payload`` (uint8 ``[PAYLOAD]``) is exactly round ``round_`` of ``writer``; else
    one sentence saying how it is torn (rounds mixed), stale (an earlier round, or never written)
    or foreign."""
    words, expected = payload.view(torch.int64).clone(), pattern(writer, round_)  # one snapshot
    if torch.equal(words, expected):
        return None
    wrong = words != expected
    sources = sorted(set(zip((words >> WRITER_SHIFT).tolist(),
                             ((words >> ROUND_SHIFT) & 0xFFFFFFF).tolist())))
    if not bool(wrong.all()) or len(sources) > 1:
        kind = "torn"
    elif (sources[0][0] == writer and sources[0][1] < round_) or not bool(words.any()):
        kind = "stale"  # an earlier round of this writer's, or never written (zeros)
    else:
        kind = "foreign"
    return (f"writer {writer} round {round_}: {kind} payload under a published flag, "
            f"{int(wrong.sum())} of {WORDS} words wrong, from (writer, round) {sources[:4]}")


@dataclass(frozen=True)
class ReadOutcome:
    """What the reader saw: payloads checked per writer, and the first defect (None if none)."""

    checked: tuple[int, ...]
    defect: str | None


def read_rounds(region: ibgda.LocalRegion, writers: int, rounds: int,
                deadline: float) -> ReadOutcome:
    """Check every published payload until each writer's ``rounds`` are in, the first defect,
    or ``deadline`` (``time.monotonic``), whichever comes first."""
    next_round = [1] * writers
    spin_until = time.perf_counter() + SPIN
    while True:
        seen = region.load_word(READER_BELL)
        for w in range(writers):
            tag = region.load_flag(flag_offset(w)) if next_round[w] <= rounds else 0
            if tag == 0:
                continue
            if tag != round_tag(next_round[w]):
                defect = f"writer {w}: flag {tag} published, round {next_round[w]} expected"
                return ReadOutcome(tuple(r - 1 for r in next_round), defect)
            defect = check_payload(region.view(payload_offset(w), PAYLOAD), w, next_round[w])
            if defect:
                return ReadOutcome(tuple(r - 1 for r in next_round), defect)
            next_round[w] += 1
            region.store_flag(flag_offset(w), 0)  # hand the slot back (release)
            region.notify(writer_bell(w))
            spin_until = time.perf_counter() + SPIN
        if min(next_round) > rounds or time.monotonic() > deadline:
            return ReadOutcome(tuple(r - 1 for r in next_round), None)
        region.idle(READER_BELL, seen, spin_until, timeout=0.01)


def start_writers(region: ibgda.LocalRegion, writers: int, rounds: int,
                  mode: str) -> list[subprocess.Popen]:
    """Writer processes, each connected and about to publish its first round."""
    handle = json.dumps(region.handle.to_dict())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # see one_torch_thread
    procs = [subprocess.Popen([sys.executable, __file__, handle, str(w), str(rounds), mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for w in range(writers)]
    for w, proc in enumerate(procs):
        assert proc.stdout.readline().strip() == "ready", f"writer {w}: {proc.stderr.read()}"
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait(30)


@pytest.fixture
def one_torch_thread():
    """The reader's torch ops on one thread, as the writers' (OMP_NUM_THREADS=1): a 64 KiB copy
    is big enough for torch to split it across OpenMP threads, whose barriers spin, and with
    more processes than cores that costs each round milliseconds (50 rounds/s instead of
    thousands)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_checker_flags_torn_stale_and_foreign_payloads():
    """Deterministic: payloads a reordered writer could leave behind are named as such."""
    payload = torch.empty(PAYLOAD, dtype=torch.uint8)
    words = payload.view(torch.int64)
    words.copy_(pattern(3, 7))
    assert check_payload(payload, 3, 7) is None
    words[WORDS // 2:] = pattern(3, 6)[WORDS // 2:]  # the second half still from round 6
    assert check_payload(payload, 3, 7) == (
        f"writer 3 round 7: torn payload under a published flag, {WORDS // 2} of {WORDS} words "
        "wrong, from (writer, round) [(3, 6), (3, 7)]")
    words.copy_(pattern(3, 6))
    assert check_payload(payload, 3, 7).startswith(
        f"writer 3 round 7: stale payload under a published flag, {WORDS} of {WORDS} words")
    words.copy_(pattern(2, 7))  # another writer's round 7
    assert "foreign payload" in check_payload(payload, 3, 7)
    words.copy_(pattern(3, 7))
    payload[12345] ^= 1  # one byte of one cache line wrong
    assert check_payload(payload, 3, 7).startswith(
        f"writer 3 round 7: torn payload under a published flag, 1 of {WORDS} words wrong")


def test_many_concurrent_writers_never_publish_a_torn_or_stale_payload(one_torch_thread):
    region = ibgda.create_transport("shm").create_region(region_bytes(WRITERS))
    writers = start_writers(region, WRITERS, ROUNDS, "ordered")
    try:
        start = time.monotonic()
        outcome = read_rounds(region, WRITERS, ROUNDS, deadline=start + 60)
        assert outcome.defect is None, outcome.defect
        assert outcome.checked == (ROUNDS,) * WRITERS, (
            f"only {outcome.checked} rounds arrived in 60 s")
        for w, proc in enumerate(writers):
            out, err = proc.communicate(timeout=30)
            assert (proc.returncode, out.strip()) == (0, "done"), f"writer {w}: {err}"
        print(f"{WRITERS * ROUNDS} payloads of {PAYLOAD} bytes checked in "
              f"{time.monotonic() - start:.1f} s")
    finally:
        stop(writers)
        region.close()


def test_a_writer_that_stores_the_flag_first_is_caught(one_torch_thread):
    """The broken variant: flag, then payload. The reader must catch a torn or stale payload
    within a few seconds; were the checker blind, this run would end without a defect."""
    writers_n, endless = 2, 10**9  # rounds until caught or the deadline
    region = ibgda.create_transport("shm").create_region(region_bytes(writers_n))
    writers = start_writers(region, writers_n, endless, "flag-first")
    try:
        outcome = read_rounds(region, writers_n, endless, deadline=time.monotonic() + 10)
        assert outcome.defect is not None, (
            f"{sum(outcome.checked)} payloads published flag-first, none caught")
        assert re.search(r"(torn|stale) payload under a published flag", outcome.defect)
        print(outcome.defect)
    finally:
        stop(writers)
        region.close()


def write_rounds(handle: str, writer: int, rounds: int, mode: str) -> None:
    """One writer process: ``rounds`` rounds, each once its slot is handed back."""
    peer = ibgda.create_transport("shm").connect(ibgda.RegionHandle.from_dict(json.loads(handle)))
    flag, data_at = flag_offset(writer), payload_offset(writer)
    print("ready", flush=True)
    for round_ in range(1, rounds + 1):
        if not peer.wait_flag(flag, 0, WAIT_TIMEOUT, bell=writer_bell(writer)):
            sys.exit(f"writer {writer}: round {round_ - 1} was not handed back in "
                     f"{WAIT_TIMEOUT:.0f} s")
        data = pattern(writer, round_)
        if mode == "ordered":
            peer.put_signal([(data_at, data)], flag, round_tag(round_))
        elif mode == "flag-first":  # deliberately broken: the flag vouches for what is not there
            peer.store_flag(flag, round_tag(round_))
            pieces = data.view(torch.uint8).chunk(BROKEN_PIECES)
            for i, piece in enumerate(pieces):  # a request's sections, one write each
                peer.write(data_at + i * pieces[0].numel(), piece)
        else:
            sys.exit(f"mode {mode!r} is not 'ordered' or 'flag-first'")
        peer.notify(READER_BELL)
    print("done", flush=True)
    peer.close()


if __name__ == "__main__":
    write_rounds(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
