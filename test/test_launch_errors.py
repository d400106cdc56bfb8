"""Bad input, as the command a user types: ``python -m sglang.launch_server ... --eaas`` with one
bad flag value (or a server, monitor or adapter that cannot serve) exits with a non-zero status
and one sentence naming the flag and the problem, no traceback, before any worker starts.

The launches fail within seconds (SGLang's import dominates); they run a few at a time, one as
the real command and the others forked from one process that imported SGLang once
(``forked_launches.py``: the same launch code after the same imports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import open_log

from sglang_eaas.addresses import free_port
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer

pytestmark = pytest.mark.slow  # each case starts SGLang's launcher (about 10 s of imports)
PARALLEL = 4


def _server_args(model, args) -> list[str]:
    """``launch_server``'s arguments for one case: the model, ``--eaas``, then ``args``."""
    return ["--model-path", str(model), "--eaas", *args]


def _launch(model, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang.launch_server",
                           *_server_args(model, args)], capture_output=True, text=True,
                          timeout=300)


def _launch_forked(model, cases: list[list[str]], tmp_path) -> list[SimpleNamespace]:
    """``_launch(model, *args)`` for each of ``cases``, forked after one import of SGLang."""
    (tmp_path / "cases.json").write_text(json.dumps(
        [_server_args(model, args) for args in cases]))
    subprocess.run([sys.executable, str(Path(__file__).parent / "forked_launches.py"),
                    str(tmp_path / "cases.json"), str(tmp_path / "results.json"),
                    str(PARALLEL)], check=True, timeout=600)
    return [SimpleNamespace(**r) for r in json.loads((tmp_path / "results.json").read_text())]


def _write(path, content) -> str:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def _random_adapter(model, out, *args: str) -> str:
    subprocess.run([sys.executable, "-m", "sglang_eaas.tools.esft", "random", str(model),
                    str(out), *args], check=True, capture_output=True, timeout=120)
    return str(out)


def test_each_bad_input_is_one_sentence_and_no_traceback(tiny_qwen3, tiny_mixtral, tmp_path):
    """(flags, what the last line of the output says) per case: the flag, then the problem."""
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    every = list(range(8))
    broken = tmp_path / "broken-adapter"
    _random_adapter(tiny_qwen3, broken, "--experts", '{"0": [1]}')
    (broken / "expert_config.json").write_text('{"experts": {"0": "one"}}')
    cases = [
        (["--eaas-placement", _write(tmp_path / "cut.yaml", "servers:\n  local:0: [0, 1\n")],
         f"--eaas-placement {tmp_path / 'cut.yaml'}: not valid JSON or YAML at line"),
        (["--eaas-placement", _write(tmp_path / "bools.json", {"servers": {"local:0": [True]}})],
         "server 'local:0' lists True, which is not an expert id"),
        (["--eaas-placement", _write(tmp_path / "gap.json", {"servers": {
            "local:0": [0, 1, 2], "local:1": [4, 5, 6, 7]}})],
         f"--eaas-placement {tmp_path / 'gap.json'}: MoE layer 0: experts [3] are on no "
         "expert server"),
        (["--eaas-placement", _write(tmp_path / "layers.json", {"servers": {
            "local:0": {"7": every}}})],
         "names layers [7], which are not MoE layers of the model"),
        (["--eaas-placement", _write(tmp_path / "nobody.json", {"servers": {nobody: every}})],
         f"--eaas-placement {tmp_path / 'nobody.json'}: expert server {nobody} is unreachable"),
        (["--eaas-autoscale", "--eaas-autoscale-ttft", "2"],
         "--eaas-autoscale needs its targets: --eaas-autoscale-ttft SECONDS and "
         "--eaas-autoscale-tpot SECONDS"),
        (["--eaas-autoscale-ttft", "2"],
         "--eaas-autoscale-ttft only apply with --eaas-autoscale"),
        (["--eaas-expert-servers", "node-a"],
         "argument --eaas-expert-servers: 'node-a' is not HOST:PORT"),
        (["--eaas-expert-servers", nobody],
         f"--eaas-expert-servers {nobody}: expert server {nobody} is unreachable"),
        (["--eaas-esft-adapters", f"a={tmp_path / 'missing'}"],
         f"argument --eaas-esft-adapters: adapter a: '{tmp_path / 'missing'}' is not a "
         "directory"),
        (["--eaas-esft-adapters", f"a={broken}"],
         f"--eaas-esft-adapters a: ESFT adapter {broken}:"),
        (["--eaas-esft-adapters", "a=" + _random_adapter(
            tiny_qwen3, tmp_path / "four", "--experts-per-layer", "4")],
         f"--eaas-esft-adapters a: {tmp_path / 'four'} replaces 4 experts in MoE layer 0, more "
         "than --eaas-esft-max-experts 2 allows"),
        (["--eaas-monitor", "zk://h:1"],
         "argument --eaas-monitor: 'zk://h:1': the only monitor URL scheme is etcd://"),
        (["--eaas-monitor", nobody], f"--eaas-monitor {nobody}: monitor {nobody} is unreachable"),
    ]
    with ThreadPoolExecutor(2) as pool:  # the first as the command a user types
        command = pool.submit(_launch, tiny_qwen3, *cases[0][0])
        results = _launch_forked(tiny_qwen3, [flags for flags, _ in cases[1:]], tmp_path)
        results.insert(0, command.result())
    for (flags, said), result in zip(cases, results):
        last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        assert result.returncode != 0, flags
        assert said in last, (flags, last)
        assert "Traceback" not in result.stdout + result.stderr, (flags, result.stderr[-3000:])


def test_servers_and_monitors_that_cannot_serve_stop_the_launch_clearly(tiny_qwen3,
                                                                       tiny_mixtral):
    """A separately started server of another model, and a shared monitor where no live server
    holds half of the experts (the launch waits --eaas-wait-for-servers, then says which)."""
    log = open_log("launch-errors-servers")
    mixtral = start_local_servers(tiny_mixtral, [list(range(8))], "float32", 1, stdout=log)[0]
    monitor = MonitorServer(MonitorConfig(token=os.environ["SGLANG_EAAS_TOKEN"])).start()
    half = start_local_servers(tiny_qwen3, [[0, 1, 2, 3]], "float32", 1, stdout=log,
                               extra_args=("--monitor", monitor.address))[0]
    try:
        with ThreadPoolExecutor(2) as pool:
            other, waited = pool.map(lambda args: _launch(tiny_qwen3, *args), [
                ("--eaas-expert-servers", mixtral.address),
                ("--eaas-monitor", monitor.address, "--eaas-wait-for-servers", "2")])
    finally:
        for server in (mixtral, half):
            server.stop()
        monitor.close()
        log.close()
    for result in (other, waited):
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert (f"--eaas-expert-servers {mixtral.address}: expert server {mixtral.address} serves "
            "a different model") in other.stderr.strip().splitlines()[-1]
    assert (f"after 2s, the monitor {monitor.address} still has no live expert server of this "
            "model for experts [4, 5, 6, 7] of MoE layer 0; experts [4, 5, 6, 7] of MoE layer 1 "
            "(--eaas-wait-for-servers)") in waited.stderr.strip().splitlines()[-1]
