"""The well-behaved client of a fuzz run, as its own process: an ``EaasClient`` that keeps
sending real requests while the fuzzers attack, checking every result against transformers'
own expert modules (loaded by its ``from_pretrained``: no code of the servers is involved).

    python -m sglang_eaas.tools.fuzz.good_client --model PATH --seed S

loads its reference first (so that it overlaps the servers' start), then reads one line from
stdin: the servers, ``HOST:PORT,...`` (together they hold every expert). It prints ``ready``
once joined and ``.`` after each request, sends requests until its stdin closes, then prints
one JSON line (``GoodClientReport``). ``GoodClientProcess`` is the other end of that exchange.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from dataclasses import asdict, dataclass, field

import torch

PAUSE = 5e-3  # seconds between requests: a steady client, not a load generator
MAX_TOKENS = 12  # tokens per request: more than the fuzz servers' --max-tokens (chunks)


@dataclass
class GoodClientReport:
    requests: int = 0
    correct: int = 0
    wrong: int = 0
    errors: int = 0
    first_problem: str = ""
    sent_per_server: list[int] = field(default_factory=list)  # requests each server received
    done_at: list[float] = field(default_factory=list)  # time.monotonic() of each request

    def to_line(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_line(cls, line: str) -> "GoodClientReport":
        return cls(**json.loads(line))


def routed_experts(model_path: str) -> dict[int, torch.nn.Module]:
    """``{layer: experts}``: transformers' routed-experts modules, eager per-expert loop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 experts_implementation="eager")
    return {i: layer.mlp.experts.eval() for i, layer in enumerate(model.model.layers)
            if hasattr(layer.mlp, "experts")}


def serve(model_path: str, servers: list[str], reference: dict[int, torch.nn.Module],
          seed: int, stop: threading.Event, on_ready=lambda: None,
          on_done=lambda: None) -> GoodClientReport:
    """Send requests to ``servers`` until ``stop``; check each against ``reference``."""
    from sglang_eaas.checkpoint import ModelIdentity
    from sglang_eaas.client.client import EaasClient
    from sglang_eaas.model_info import MoeModelInfo

    info = MoeModelInfo.from_model_path(model_path)
    # It sleeps on its doorbells at once (no spin): its CPU is the fuzzed server's to use.
    client = EaasClient(servers, info, ModelIdentity.of(model_path, info), torch.float32, "good",
                        result_timeout=30.0, poll_spin=0.0)
    report, g = GoodClientReport(), torch.Generator().manual_seed(seed)
    first_seqs = [conn.slot.seq for conn in client.connections]  # a join's sequence base
    on_ready()
    try:
        while not stop.is_set():
            tokens = int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=g))
            layer = info.moe_layers[int(torch.randint(len(info.moe_layers), (1,), generator=g))]
            x = torch.randn(tokens, info.hidden_size, generator=g)
            ids = torch.stack([torch.randperm(info.num_experts, generator=g)[: info.top_k]
                               for _ in range(tokens)])
            weights = torch.rand(tokens, info.top_k, generator=g)
            report.requests += 1
            try:
                out = client.forward(layer, x, ids, weights)
            except Exception as exc:  # a refused, lost or late answer: counted, reported
                report.errors += 1
                report.first_problem = report.first_problem or f"request failed: {exc}"
                time.sleep(PAUSE)
                continue
            with torch.no_grad():
                expected = reference[layer](x, ids.long(), weights)
            scale = float(expected.abs().max())
            if torch.allclose(out, expected, rtol=1e-5, atol=1e-5 * scale):
                report.correct += 1
            else:
                report.wrong += 1
                report.first_problem = report.first_problem or (
                    f"layer {layer}, {tokens} tokens: result differs from transformers' by "
                    f"{float((out - expected).abs().max()):.3g} (scale {scale:.3g})")
            report.done_at.append(time.monotonic())
            on_done()
            time.sleep(PAUSE)
        report.sent_per_server = [conn.slot.seq - first
                                  for conn, first in zip(client.connections, first_seqs)]
    finally:
        client.close()
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_eaas.tools.fuzz.good_client",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the servers' checkpoint folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # idle intra-op threads would spin on the cores the servers use
    reference = routed_experts(args.model)
    servers = sys.stdin.readline().strip().split(",")
    stop = threading.Event()

    def wait_for_stdin_to_close() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_stdin_to_close, daemon=True).start()
    report = serve(args.model, servers, reference, args.seed, stop,
                   on_ready=lambda: print("ready", flush=True),
                   on_done=lambda: print(".", flush=True))
    print(report.to_line(), flush=True)


class GoodClientProcess:
    """The fuzz run's end: starts the process, hands it the servers, follows its progress,
    stops it and takes its report."""

    def __init__(self, model_path: Path, seed: int, log, preexec_fn=None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sglang_eaas.tools.fuzz.good_client", "--model",
             str(model_path), "--seed", str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            preexec_fn=preexec_fn)
        self.done, self.ready, self.report_line, self.ended = 0, False, "", False
        self._changed = threading.Condition()
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                if line == ".\n":
                    self.done += 1
                elif line == "ready\n":
                    self.ready = True
                else:
                    self.report_line = line
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def _wait(self, condition, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: condition() or self.ended, timeout) and \
                condition()

    def start(self, servers: list[str], timeout: float) -> None:
        """Hand over the servers; returns once the client has joined them all."""
        self.process.stdin.write(",".join(servers) + "\n")
        self.process.stdin.flush()
        if not self._wait(lambda: self.ready, timeout):
            raise RuntimeError("the good client did not join the servers (see its log)")

    def served_since(self, done: int, timeout: float) -> bool:
        """Wait until more than ``done`` requests are through; whether they are."""
        return self._wait(lambda: self.done > done, timeout)

    def stop(self, timeout: float = 60.0) -> GoodClientReport:
        self.process.stdin.close()
        if not self._wait(lambda: bool(self.report_line), timeout):
            raise RuntimeError("the good client did not report (see its log)")
        self.process.wait(timeout)
        return GoodClientReport.from_line(self.report_line)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


if __name__ == "__main__":
    main()
