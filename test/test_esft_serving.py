"""ESFT adapters served over the trained checkpoint (models/tiny-moe-stdlib) by one SGLang
``--eaas`` server: three local expert servers (every base expert on each), an embedded monitor,
the shipped trained adapters plus random ones for the edge cases (an adapter with experts in one
layer only, one with the whole per-layer budget in one layer, two replacing the same expert),
each adapter expert on two servers.

The reference of each adapter is its merged checkpoint (``tools.esft merge``) served by plain
monolithic SGLang (one server; ``/update_weights_from_disk`` swaps in each merged checkpoint),
float32, greedy: tokens must be identical. Then: a mixed batch with interleaved arrivals,
SGLang's request fields and errors (unknown adapter: 4xx), ``/v1/models``, the radix cache never
shared across adapters, adapters refused at registration, load/unload churn with no leaked
expert memory, an unload while a request uses the adapter, and last a server holding adapter
experts killed (its replicas take over).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from conftest import TEST_LOGS, start_server
from sglang_eaas.esft.adapter import load_adapter
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.membership import connect
from sglang_eaas.protocol.control import probe
from sglang_eaas.addresses import free_port

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]  # SGLang through the CPU runtime

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]
MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-moe-stdlib"
INFO = MoeModelInfo.from_model_path(MODEL)
TRAINED = sorted(p for p in (MODEL / "adapters").iterdir() if p.is_dir())
BUDGET = INFO.num_experts // 4  # --eaas-esft-max-experts' default
RANDOM = {  # name -> experts replaced per layer
    "sparse": {"1": [9]},  # no experts in layers 0, 2, 3
    "full": {"2": list(range(BUDGET))},  # the whole per-layer budget in one layer
    "twin-a": {"0": [1, 2], "3": [5]},
    "twin-b": {"0": [2, 7], "2": [5]},  # expert 2 of layer 0 replaced by both twins
}
PROMPTS = (  # the base model's domain, then the shipped adapters' (tests, man pages, changelogs)
    'def read_config(path):\n    """',
    "    def test_read_config(self):\n        self.assert",
    ".TH LS 1\n.SH NAME\nls \\- list",
    "python3 (3.11.2-6) unstable; urgency=medium\n\n  * ",
)
NEW_TOKENS = 20
REPLICAS = 2


def _esft(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "sglang_eaas.tools.esft", *args], check=True,
                   capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    """name -> adapter directory: the trained ones, then the random edge cases."""
    out = {p.name: p for p in TRAINED}
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, experts) in enumerate(RANDOM.items()):
        _esft("random", str(MODEL), str(root / name), "--seed", str(seed), "--experts",
              json.dumps(experts))
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def expected(adapters, eaas_starting, tmp_path_factory) -> dict[str | None, list[list[int]]]:
    """Adapter (None: the base model) -> its greedy tokens, served monolithically from its
    merged checkpoint (while the --eaas server starts: ``eaas_starting``)."""
    merged = tmp_path_factory.mktemp("merged")
    server = start_server(MODEL, name="esft-monolithic")
    try:
        out = {None: _tokens(server)}
        for name, path in adapters.items():
            _esft("merge", str(MODEL), str(path), str(merged / name))
            reply = server._post("/update_weights_from_disk",
                                 {"model_path": str(merged / name)})
            assert reply["success"], reply
            out[name] = _tokens(server)
    finally:
        server.stop()
    same = [name for name in adapters if out[name] == out[None]]
    assert not same, f"adapters {same} changed no token"
    return out


@pytest.fixture(scope="module")
def eaas_starting(adapters, tmp_path_factory):
    """The --eaas server, started on a thread: its start overlaps the monolithic one's and the
    merges in ``expected`` (start-up is mostly single-threaded imports)."""
    placement = tmp_path_factory.mktemp("placement") / "placement.json"
    every = {str(layer): list(range(INFO.num_experts)) for layer in INFO.moe_layers}
    placement.write_text(json.dumps({"servers": {f"local:{i}": every for i in range(3)}}))
    monitor = f"127.0.0.1:{free_port()}"
    launched = ",".join(f"{n}={p}" for n, p in adapters.items() if n != "twin-b")

    def start():
        server = start_server(MODEL, "--eaas", "--eaas-placement", str(placement),
                              "--eaas-monitor", f"embedded:{monitor}", "--eaas-esft-adapters",
                              launched, "--eaas-esft-replicas", str(REPLICAS), name="esft-eaas")
        server.monitor = monitor
        return server

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(start)
        yield future
    if future.exception() is None:
        future.result().stop()


@pytest.fixture(scope="module")
def eaas(eaas_starting, expected):
    return eaas_starting.result()


def _tokens(server, adapter: str | None = None) -> list[list[int]]:
    return [server.generate(p, NEW_TOKENS, adapter=adapter)["output_ids"] for p in PROMPTS]


def _servers(monitor: str) -> dict[str, dict]:
    watcher = connect(monitor, TOKEN)
    try:
        return {m.id: probe(m.id, TOKEN) for m in watcher.watch(-1, 0.0).servers()}
    finally:
        watcher.close()


def _expert_bytes() -> int:
    return 3 * INFO.hidden_size * INFO.moe_intermediate_size * 4  # gate, up, down; float32


def test_each_adapter_matches_its_merged_checkpoint(eaas, expected, adapters):
    assert _tokens(eaas) == expected[None]
    for name in adapters:
        if name != "twin-b":
            assert _tokens(eaas, name) == expected[name], name


def test_adapter_experts_cost_only_what_they_replace(eaas, adapters):
    """Memory grows with the experts adapters really replace (times their copies), no
    per-adapter maximum: the servers' weight bytes against the base model's."""
    stats = _servers(eaas.monitor)
    base = len(stats) * len(INFO.moe_layers) * INFO.num_experts * _expert_bytes()
    replaced = sum(load_adapter(p, INFO).count for n, p in adapters.items() if n != "twin-b")
    assert sum(s.weight_bytes for s in stats.values()) - base == (
        replaced * REPLICAS * _expert_bytes())
    held = [(layer, p) for s in stats.values() for layer, by in s.holdings.adapters.items()
            for p in by]
    assert len(held) == replaced * REPLICAS


def test_a_mixed_batch_with_interleaved_arrivals(eaas, expected, adapters):
    names = [None, *[n for n in adapters if n != "twin-b"]]
    jobs = [(name, i) for name in names for i in range(len(PROMPTS))] * 2

    def run(job):
        name, i = job
        time.sleep(0.02 * (hash((name, i)) % 7))  # arrivals interleave with running decodes
        return job, eaas.generate(PROMPTS[i], NEW_TOKENS, adapter=name)["output_ids"]

    with ThreadPoolExecutor(len(jobs)) as pool:
        for (name, i), tokens in pool.map(run, jobs):
            assert tokens == expected[name][i], (name, i)


def test_requests_name_adapters_as_sglang_users_do(eaas, expected):
    name = TRAINED[0].name
    assert expected[name][0] != expected[None][0]  # the prompt tells the adapter from base
    body = {"prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0.0,
            "ignore_eos": True}
    for model in (f"{MODEL}:{name}", name):
        reply = requests.post(f"{eaas.url}/v1/completions", json={**body, "model": model},
                              timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == eaas.generate(
            PROMPTS[0], NEW_TOKENS, adapter=name)["text"], model
    models = requests.get(f"{eaas.url}/v1/models", timeout=30).json()
    listed = {m["id"] for m in models["data"]}
    assert {n for n in [p.name for p in TRAINED]} <= listed
    for bad in ({"text": PROMPTS[0], "lora_path": "no-such-adapter"},):
        reply = requests.post(f"{eaas.url}/generate", json=bad, timeout=60)
        assert 400 <= reply.status_code < 500, reply.text
        assert "no-such-adapter" in reply.text
    for model in ("no-such-adapter", f"{MODEL}:no-such-adapter"):
        reply = requests.post(f"{eaas.url}/v1/completions", json={**body, "model": model},
                              timeout=60)
        assert 400 <= reply.status_code < 500, reply.text
        assert "no-such-adapter" in reply.text


def test_the_radix_cache_never_shares_across_adapters(eaas, expected):
    """The same new prompt to base, then A, then B: each as its merged checkpoint serves it,
    none reusing another's cached prefix; again to A: its own prefix is reused."""
    prompt = "@@radix_cache_probe(value):\n    return"  # no earlier prompt starts so
    a, b = TRAINED[0].name, TRAINED[1].name
    first = {}
    for name in (None, a, b):
        reply = eaas.generate(prompt, NEW_TOKENS, adapter=name)
        assert reply["meta_info"]["cached_tokens"] == 0, name
        first[name] = reply["output_ids"]
    again = eaas.generate(prompt, NEW_TOKENS, adapter=a)
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == first[a]
    assert len({tuple(t) for t in first.values()}) == 3


def _load(eaas, name: str, path: Path) -> requests.Response:
    return requests.post(f"{eaas.url}/load_lora_adapter",
                         json={"lora_name": name, "lora_path": str(path)}, timeout=120)


def _unload(eaas, name: str) -> requests.Response:
    return requests.post(f"{eaas.url}/unload_lora_adapter", json={"lora_name": name},
                         timeout=120)


def test_bad_adapters_are_refused_at_registration(eaas, tmp_path):
    over = tmp_path / "over-budget"
    _esft("random", str(MODEL), str(over), "--experts",
          json.dumps({"1": list(range(BUDGET + 1))}))
    shared = tmp_path / "shared"
    _esft("random", str(MODEL), str(shared), "--experts", json.dumps({"0": [1]}))
    config = json.loads((shared / "expert_config.json").read_text())
    (shared / "expert_config.json").write_text(json.dumps({**config, "shared_experts": True}))
    for name, path, words in (("over", over, "budget"), ("shared", shared, "shared")):
        reply = _load(eaas, name, path)
        assert not reply.ok or not reply.json()["success"], reply.text
        assert words in reply.text.lower()
    assert _tokens(eaas) is not None  # serving goes on


def test_load_unload_churn_leaks_no_expert_memory(eaas, expected, adapters):
    before = sum(s.weight_bytes for s in _servers(eaas.monitor).values())
    steady, stop = [], threading.Event()

    def traffic():  # another adapter's requests run throughout
        while not stop.is_set():
            steady.append(eaas.generate(PROMPTS[1], NEW_TOKENS, adapter=TRAINED[0].name)
                          ["output_ids"])

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        for _ in range(3):
            reply = _load(eaas, "twin-b", adapters["twin-b"])
            assert reply.ok and reply.json()["success"], reply.text
            assert _tokens(eaas, "twin-b") == expected["twin-b"]
            assert _tokens(eaas, "twin-a") == expected["twin-a"]  # shares expert 2 of layer 0
            reply = _unload(eaas, "twin-b")
            assert reply.ok and reply.json()["success"], reply.text
    finally:
        stop.set()
        worker.join()
    assert steady and all(t == expected[TRAINED[0].name][1] for t in steady)
    deadline = time.monotonic() + 30  # unloaded experts are freed after the drop's grace
    while sum(s.weight_bytes for s in _servers(eaas.monitor).values()) != before:
        assert time.monotonic() < deadline, "an unloaded adapter's experts were not freed"
        time.sleep(0.5)


def test_an_unload_waits_for_the_requests_using_the_adapter(eaas, expected, adapters):
    assert _load(eaas, "twin-b", adapters["twin-b"]).json()["success"]
    long = {}
    worker = threading.Thread(target=lambda: long.update(
        eaas.generate(PROMPTS[0], 96, adapter="twin-b")))
    worker.start()
    time.sleep(0.5)  # the request runs
    reply = _unload(eaas, "twin-b")
    worker.join()
    assert reply.ok and reply.json()["success"], reply.text
    assert long["output_ids"][:NEW_TOKENS] == expected["twin-b"][0]
    listed = {m["id"] for m in requests.get(f"{eaas.url}/v1/models", timeout=30).json()["data"]}
    assert "twin-b" not in listed
    # As SGLang does for LoRA, a request naming an adapter it has unloaded loads it again.
    assert _tokens(eaas, "twin-b") == expected["twin-b"]
    assert _unload(eaas, "twin-b").json()["success"]


def test_tensor_parallel_ranks_find_the_experts_rank_0_placed(expected, adapters):
    """--tp 2: rank 0 places each adapter's experts, rank 1 finds them in its table; both
    reroute their share of the tokens the same way."""
    names = [TRAINED[0].name, "twin-b"]
    server = start_server(MODEL, "--tp", "2", "--eaas", "--eaas-expert-servers", "local:2",
                          "--eaas-esft-adapters",
                          ",".join(f"{n}={adapters[n]}" for n in names), name="esft-tp2")
    try:
        assert _tokens(server) == expected[None]
        for name in names:
            assert _tokens(server, name) == expected[name], name
    finally:
        server.stop()
    log = (TEST_LOGS / "esft-tp2.log").read_text()
    assert log.count("experts placed on") == len(names)  # by rank 0 only


def test_a_server_holding_adapter_experts_killed(eaas, expected, adapters):
    """Runs last: one of the three expert servers is killed while adapter requests run; every
    adapter expert has another copy, so no request fails and no token changes."""
    stats = _servers(eaas.monitor)
    victim = max(stats, key=lambda s: sum(len(by)
                                          for by in stats[s].holdings.adapters.values()))
    assert stats[victim].holdings.adapters
    names = [n for n in adapters if n not in ("twin-b",)]
    results = {}

    def run(name):
        results[name] = _tokens(eaas, name)

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads:
        t.start()
    time.sleep(0.3)
    os.kill(stats[victim].pid, signal.SIGKILL)
    for t in threads:
        t.join()
    for name in names:
        assert results[name] == expected[name], name
    assert _tokens(eaas, names[0]) == expected[names[0]]
    log = (TEST_LOGS / "esft-eaas.log").read_text()
    assert victim in log
