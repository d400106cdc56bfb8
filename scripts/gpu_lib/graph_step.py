"""GPU check: the client's device step captured in one CUDA graph and replayed across routing-table
changes among the same two expert servers.

    python -m gpu_lib.graph_step [--model DIR] [--tokens N] [--replays N] [--server-log FILE]

Two expert servers started with ``--transport device`` (their slots in GPU memory, shared with the
client over CUDA IPC; the experts themselves are computed on the CPU, as the expert server does)
serve the committed trained model, experts 0 and E/2 on both. One client on the device path
captures every MoE layer's exchange (``EaasClient.forward``, what SGLang's decode graph would
capture) in one ``torch.cuda.CUDAGraph``; a second client on the host path is the reference, as
in test/test_device_step.py: the same servers, the same table, bit-identical sums. Between
replays the client is given a new table (``EaasClient.stage``, copied into the same device
tensors, no new capture):

  1. both replicas used (entries of experts 0 and E/2 alternate between their holders);
  2. no replica used (every expert on one server): the same graph now sends them elsewhere;
  3. a wrong table (server 0 named for an expert only server 1 holds): the replay must fail the
     host check (``check_every_step``) with FOREIGN_EXPERT naming server 0, so the graph did read
     the new table;
  4. table 2 again (a newer epoch): replays pass again.

Then each layer's exchange is timed, eager (``forward`` per layer, checked) against the graph's
replay (one replay for every layer, then the host check). Prints ``RESULT: name=value`` lines,
which scripts/gpu_check.sh copies into its report. Exit 0 when every check held, 1 when one
failed (the line says which), 2 without a GPU.

``--cpu-twin`` runs the same sequence without a GPU, to check the script itself: the device
kernels under the Triton interpreter on /dev/shm slots, and each "replay" an eager step (no graph
is captured, so it proves nothing about CUDA graphs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny-moe-stdlib"
MAX_TOKENS = 16  # per request: a batch of more tokens is sent in several chunks


class CheckFailed(Exception):
    """One of the script's checks did not hold (the message says which)."""


def result(name: str, value) -> None:
    print(f"RESULT: {name}={value}", flush=True)


def placements(num_experts: int) -> list[list[int]]:
    """Server 0 holds the first half and E/2, server 1 the second half and 0."""
    half = num_experts // 2
    return [list(range(half)) + [half], list(range(half, num_experts)) + [0]]


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Batch:
    """Static input buffers the graph reads, refilled before each replay."""

    def __init__(self, info, tokens: int):
        self.info, self.tokens = info, tokens
        self.x = torch.zeros(tokens, info.hidden_size, device=device())
        self.ids = {layer: torch.zeros(tokens, info.top_k, dtype=torch.int64, device=device())
                    for layer in info.moe_layers}
        self.weights = torch.zeros(tokens, info.top_k, device=device())

    def fill(self, seed: int) -> None:
        """Random hidden states and weights; every row routes a replicated expert (0 or E/2)
        and E/2 + 1 (on server 1 only), the other entries at random, all distinct."""
        g = torch.Generator().manual_seed(seed)
        num, half = self.info.num_experts, self.info.num_experts // 2
        self.x.copy_(torch.randn(self.tokens, self.info.hidden_size, generator=g))
        self.weights.copy_(torch.rand(self.tokens, self.info.top_k, generator=g))
        for layer, ids in self.ids.items():
            rows = []
            for t in range(self.tokens):
                fixed = [0 if (t + layer) % 2 else half, half + 1]
                rest = [e for e in torch.randperm(num, generator=g).tolist() if e not in fixed]
                rows.append((fixed + rest)[: self.info.top_k])
            ids.copy_(torch.tensor(rows))

    def host(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x.cpu(), self.ids[layer].cpu(), self.weights.cpu()


def forwards(client, batch: Batch) -> list[torch.Tensor]:
    """One decode step's MoE exchanges: every layer's ``forward`` (what a graph captures)."""
    return [client.forward(layer, batch.x, batch.ids[layer], batch.weights)
            for layer in batch.info.moe_layers]


def step(client, batch: Batch) -> list[torch.Tensor]:
    """``forwards`` as one step of the client (its step boundaries are host work: SGLang's
    model runner marks them outside the graph)."""
    client.begin_step()
    try:
        return forwards(client, batch)
    finally:
        client.end_step()


def reference(host, batch: Batch) -> list[torch.Tensor]:
    """The host path's sums over CPU tensors: what the device path must equal bit for bit."""
    return [host.forward(layer, *batch.host(layer)) for layer in batch.info.moe_layers]


class EagerSteps:
    """``--cpu-twin``'s stand-in for a graph: each replay runs the step eagerly into the same
    output tensors."""

    def __init__(self, client, batch: Batch):
        self.client, self.batch = client, batch
        self.outs = step(client, batch)

    def replay(self) -> None:
        for out, new in zip(self.outs, step(self.client, self.batch)):
            out.copy_(new)


def capture(client, batch: Batch) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor], str]:
    """``step`` captured once; SGLang's default capture mode first, a thread-local one if the
    global mode fails (another thread's CUDA call during capture), which is reported."""
    if not torch.cuda.is_available():
        eager = EagerSteps(client, batch)
        return eager, eager.outs, "no graph: the CPU twin"
    errors = []
    for mode in ("global", "thread_local"):
        graph = torch.cuda.CUDAGraph()
        client.begin_step()
        try:
            with torch.cuda.graph(graph, capture_error_mode=mode):
                outs = forwards(client, batch)
            return graph, outs, mode
        except Exception as exc:  # noqa: BLE001 - reported, then the other mode is tried
            errors.append(f"{mode}: {type(exc).__name__}: {exc}")
            result(f"capture_{mode}", f"failed: {errors[-1]}")
        finally:
            client.end_step()
    raise CheckFailed("the device step could not be captured: " + " | ".join(errors))


def replay(graph, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    from sglang_eaas.client.device_step import check_every_step

    graph.replay()
    synchronize()
    check_every_step()
    return [o.cpu() for o in outs]


def expect_equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for layer, (g, w) in enumerate(zip(got, want)):
        if not torch.equal(g, w):
            diff = (g - w).abs().max().item()
            raise CheckFailed(f"{what}: layer {layer}'s sum differs from the host path's "
                              f"(max |diff| {diff:.3g})")
        if not w.abs().sum() > 0:
            raise CheckFailed(f"{what}: layer {layer}'s sum is all zero")


def median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_checks(args, servers, client, host, info) -> None:
    from ibgda import TransportError
    from sglang_eaas.routing_table import RoutingTable

    step_ = client.device_step
    if step_ is None:
        raise CheckFailed("the client did not take the device path over its servers")
    result("channels", ",".join(type(c.region).__name__ for c in step_.channels))
    addresses = [s.address for s in servers]
    half = info.num_experts // 2
    epoch = [max(client.view.epoch, host.view.epoch)]

    def table(experts: list[list[int]]) -> RoutingTable:
        epoch[0] += 1
        return RoutingTable.uniform(epoch[0], dict(zip(addresses, experts)),
                                    list(info.moe_layers), info.num_experts)

    def use(t: RoutingTable) -> None:
        client.stage(t)
        host.stage(t)
        if client.device_step is not step_ or step_.routing.epoch != t.epoch:
            raise CheckFailed(f"table {t.epoch} did not reach the captured step's tensors")

    batch = Batch(info, args.tokens)
    use(table(placements(info.num_experts)))
    pointers = (step_.routing.holders.data_ptr(), step_.routing.replicas.data_ptr())
    batch.fill(0)
    for _ in range(2):  # warm-up: header templates and answer buffers of this shape
        expect_equal([o.cpu() for o in step(client, batch)], reference(host, batch), "eager")
    result("eager_equals_host", "yes")
    graph, outs, mode = capture(client, batch)
    result("captured", f"{len(info.moe_layers)} MoE layers x {args.tokens} tokens in one graph "
                       f"({mode} capture mode)")
    seed = 1
    single = [list(range(half)), list(range(half, info.num_experts))]
    wrong = [list(range(half)) + [half + 1], [e for e in range(half, info.num_experts)
                                               if e != half + 1]]
    for name, experts in (("replicas", placements(info.num_experts)), ("single", single)):
        if name == "single":
            use(table(experts))
        for _ in range(args.replays):
            batch.fill(seed)
            seed += 1
            expect_equal(replay(graph, outs), reference(host, batch), f"replay ({name} table)")
        result(f"replays_{name}_table", f"{args.replays} equal to the host path")
    use(table(wrong))
    batch.fill(seed)
    try:
        replay(graph, outs)
        raise CheckFailed("a replay under a wrong table passed the host check")
    except TransportError as exc:
        if f"{addresses[0]} rejected a request: FOREIGN_EXPERT" not in str(exc):
            raise CheckFailed(f"the wrong table's replay failed otherwise: {exc}") from None
    result("wrong_table", "replay refused by server 0 (FOREIGN_EXPERT), raised by the host check")
    use(table(single))
    batch.fill(seed + 1)
    expect_equal(replay(graph, outs), reference(host, batch), "replay after the wrong table")
    result("replay_after_wrong_table", "equal to the host path")
    if (step_.routing.holders.data_ptr(), step_.routing.replicas.data_ptr()) != pointers:
        raise CheckFailed("the routing tensors moved: the graph would read stale ones")
    eager = median_ms(lambda: step(client, batch), args.timing_repeats)
    replayed = median_ms(lambda: replay(graph, outs), args.timing_repeats)
    result("eager_step_ms", f"{eager:.3f} (median of {args.timing_repeats}, "
                            f"{len(info.moe_layers)} layers, {args.tokens} tokens)")
    result("graph_replay_ms", f"{replayed:.3f} (median of {args.timing_repeats}, with host check)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gpu_lib.graph_step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL,
                        help="MoE checkpoint the servers serve (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=20,
                        help=f"tokens per step; more than {MAX_TOKENS} go in several requests "
                             "(default %(default)s)")
    parser.add_argument("--replays", type=int, default=3,
                        help="replays checked under each good table (default %(default)s)")
    parser.add_argument("--timing-repeats", type=int, default=20,
                        help="timed eager steps and replays; the median is reported "
                             "(default %(default)s)")
    parser.add_argument("--server-log", type=Path, default=None,
                        help="file for the expert servers' output (default: this output)")
    parser.add_argument("--cpu-twin", action="store_true",
                        help="without a GPU: the same sequence on the CPU twin (Triton "
                             "interpreter, eager steps instead of a graph), to check the script")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.replays < 1 or args.timing_repeats < 1:
        parser.error("--tokens, --replays and --timing-repeats must be >= 1")
    if not (args.model / "config.json").exists():
        parser.error(f"--model {args.model} has no config.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_twin and torch.cuda.is_available():
        print("graph_step: --cpu-twin is for machines without a GPU; this one has one.")
        return 2
    if args.cpu_twin:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    elif not torch.cuda.is_available():
        print("graph_step: torch sees no CUDA device, so there is no graph to capture "
              "(--cpu-twin checks the script on the CPU).")
        return 2
    from sglang_eaas.checkpoint import ModelIdentity
    from sglang_eaas.client.client import EaasClient
    from sglang_eaas.launcher.local_servers import start_local_servers
    from sglang_eaas.model_info import MoeModelInfo

    info = MoeModelInfo.from_model_path(args.model)
    identity = ModelIdentity.of(args.model, info)
    log = open(args.server_log, "w") if args.server_log else None
    servers, clients = [], []
    try:
        servers = start_local_servers(args.model, placements(info.num_experts), "float32",
                                      max_clients=3, stdout=log, extra_args=(
                                          "--transport", "device", "--max-tokens",
                                          str(MAX_TOKENS)))
        for name in ("graph-step", "graph-step-reference"):
            clients.append(EaasClient([s.address for s in servers], info, identity,
                                      torch.float32, name, result_timeout=30.0,
                                      transport="device"))
        clients[1].device_step = None  # the host path over the same servers
        run_checks(args, servers, *clients, info)
    except CheckFailed as exc:
        result("failed", exc)
        return 1
    except Exception as exc:  # noqa: BLE001 - a check script: the traceback is the finding
        traceback.print_exc()
        result("failed", f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.stop()
        if log:
            log.close()
    result("passed", "every check held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
